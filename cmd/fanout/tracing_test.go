package main

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/fanout/fanout/internal/testenv/redistest"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/shop"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// collector receives OTLP/HTTP trace exports, decoded from the protobuf
// the exporter sends, as a collector would.
type collector struct {
	mu       sync.Mutex
	spans    []*tracepb.Span
	services []string
}

func startCollector(t *testing.T) (*collector, string) {
	t.Helper()
	c := &collector{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if err != nil || r.URL.Path != "/v1/traces" || proto.Unmarshal(body, &req) != nil {
			http.Error(w, "not an OTLP trace export", http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		for _, rs := range req.GetResourceSpans() {
			for _, attr := range rs.GetResource().GetAttributes() {
				if attr.GetKey() == "service.name" {
					c.services = append(c.services, attr.GetValue().GetStringValue())
				}
			}
			for _, ss := range rs.GetScopeSpans() {
				c.spans = append(c.spans, ss.GetSpans()...)
			}
		}
		c.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return c, "http://" + ln.Addr().String() + "/v1/traces"
}

// childOf returns the spans of trace id whose parent is span parent.
func (c *collector) childOf(id trace.TraceID, parent trace.SpanID) []*tracepb.Span {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range c.spans {
		if bytes.Equal(s.GetTraceId(), id[:]) && bytes.Equal(s.GetParentSpanId(), parent[:]) {
			out = append(out, s)
		}
	}
	return out
}

// With tracing.exporter otlp, a subscriber exports its handling span to
// the collector, as the child of the span the writer had in its context.
func TestSpansReachAnOTLPCollector(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	nats := natstest.Start(t)
	redis := redistest.Start(t)
	col, endpoint := startCollector(t)
	env := []string{
		"FANOUT_POSTGRES_URL=" + db.URL, "FANOUT_NATS_URL=" + nats.URL, "FANOUT_REDIS_URL=" + redis.URL,
		"FANOUT_LOG_FORMAT=json", "FANOUT_HTTP_ADDR=127.0.0.1:0", "FANOUT_RELAY_POLL_INTERVAL=50ms",
		"FANOUT_TRACING_EXPORTER=otlp", "FANOUT_TRACING_OTLP_ENDPOINT=" + endpoint,
	}
	ctx := context.Background()
	if _, err := shop.Seed(ctx, db.Pool, 3, rand.New(rand.NewPCG(6, 6))); err != nil {
		t.Fatal(err)
	}
	var product int64
	if err := db.Pool.QueryRow(ctx, `SELECT min(id) FROM products`).Scan(&product); err != nil {
		t.Fatal(err)
	}
	start(t, env, "relay")
	sub := start(t, env, "subscribe", "cacheinval")
	sub.waitStarted(t, "cacheinval")

	// The writer's request span, as if it came from an instrumented HTTP
	// handler upstream.
	var traceID trace.TraceID
	var spanID trace.SpanID
	for i := range traceID {
		traceID[i] = byte(rand.IntN(256))
	}
	for i := range spanID {
		spanID[i] = byte(rand.IntN(256))
	}
	wctx := trace.ContextWithSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled, Remote: true}))
	err := pgx.BeginFunc(wctx, db.Pool, func(tx pgx.Tx) error {
		_, err := shop.UpdatePrice(wctx, tx, product, 4242)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// Spans leave in batches; a clean stop flushes the last one.
	subscribertest.WaitFor(t, 30*time.Second, "the price change handled", func() (bool, string) {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE subscriber = 'cacheinval' AND event_id = (SELECT max(id) FROM outbox)`).Scan(&n)
		return n == 1, ""
	})
	if err := sub.terminate(t, 30*time.Second); err != nil {
		t.Fatalf("fanout subscribe cacheinval exited with %v after SIGTERM", err)
	}
	spans := col.childOf(traceID, spanID)
	if len(spans) != 1 || spans[0].GetName() != "cacheinval product.updated" {
		var names []string
		for _, s := range spans {
			names = append(names, s.GetName())
		}
		t.Fatalf("spans in the writer's trace under its span: %v; want the subscriber's handling span\n%s", names, sub.output())
	}
	col.mu.Lock()
	services := col.services
	col.mu.Unlock()
	if len(services) == 0 || services[0] != "fanout" {
		t.Errorf("service.name of the exported spans: %v, want fanout", services)
	}
}
