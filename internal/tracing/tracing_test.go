package tracing_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/fanout/fanout/internal/tracing"
	"go.opentelemetry.io/otel"
)

// The OTLP exporter's credentials (its headers, and what is in its
// endpoint's URL) reach the collector, or are said not to, and never the
// logs: not in OpenTelemetry's complaint about a malformed header, not in
// a collector's refusal that quotes them back, not in the flush's error.
func TestOTLPCredentialsStayOutOfLogs(t *testing.T) {
	var mu sync.Mutex
	var auth []string
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		auth = append(auth, r.Header.Get("Authorization"))
		mu.Unlock()
		_, _ = io.Copy(io.Discard, r.Body)
		http.Error(w, "refused: "+r.Header.Get("Authorization")+" "+r.Header.Get("X-Api-Key"), http.StatusUnauthorized)
	}))
	defer collector.Close()
	// The traces' variable wins over the general one, which is still read.
	t.Setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-general=GeneralS3cret")
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "authorization=Bearer%20HeaderS3cret,x-api-key=KeyS3cret,x-other:MalformedS3cret")

	var logs syncbuf.Buffer
	logger := logging.New(&logs, "json", "info")
	endpoint := strings.Replace(collector.URL, "http://", "http://otel:UserinfoS3cret@", 1) + "/v1/traces?api_key=QueryS3cret"
	ctx := context.Background()
	shutdown, err := tracing.Setup(ctx, tracing.Config{Exporter: "otlp", OTLPEndpoint: endpoint}, io.Discard, logger)
	if err != nil {
		t.Fatal(err)
	}
	_, span := otel.Tracer("test").Start(ctx, "refused")
	span.End()
	err = shutdown(ctx)
	out := logs.String()
	if err != nil {
		out += "\nshutdown: " + err.Error()
	}

	mu.Lock()
	defer mu.Unlock()
	if len(auth) == 0 || auth[0] != "Bearer HeaderS3cret" {
		t.Fatalf("the collector got authorization %q, want the header's bearer token (the test proves nothing else)", auth)
	}
	if strings.Contains(out, "S3cret") {
		t.Errorf("the logs show a credential:\n%s", out)
	}
	for _, want := range []string{"401", "parse headers", "sends neither the user info nor the query", "otel:xxxxx@127.0.0.1", "api_key=xxxxx"} {
		if !strings.Contains(out, want) {
			t.Errorf("the logs do not say %q:\n%s", want, out)
		}
	}
}
