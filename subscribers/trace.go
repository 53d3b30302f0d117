package subscribers

import (
	"context"

	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// tracer starts the spans of event handling. With no TracerProvider
// configured (tracing.exporter none, the default) spans are not recorded,
// but the writer's trace context still reaches the handler's ctx.
var tracer = otel.Tracer("github.com/fanout/fanout/subscribers")

var w3c = propagation.TraceContext{}

// headerCarrier lets the W3C propagator read NATS headers.
type headerCarrier nats.Header

func (h headerCarrier) Get(key string) string { return nats.Header(h).Get(key) }
func (h headerCarrier) Set(key, value string) { nats.Header(h).Set(key, value) }
func (h headerCarrier) Keys() []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	return keys
}

// eventContext continues the event's trace (its traceparent header) in a
// span for subscriber's handling.
func eventContext(ctx context.Context, subscriber string, ev Event) (context.Context, trace.Span) {
	if ev.Headers != nil {
		ctx = w3c.Extract(ctx, headerCarrier(ev.Headers))
	}
	return tracer.Start(ctx, subscriber+" "+ev.Type,
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("messaging.system", "nats"),
			attribute.String("messaging.destination.name", ev.Subject),
			attribute.Int64("fanout.event_id", ev.ID),
			attribute.String("fanout.subscriber", subscriber),
		))
}

// batchContext is the span of a batch handled at once, linked to each
// event's trace.
func batchContext(ctx context.Context, subscriber string, evs []Event) (context.Context, trace.Span) {
	links := make([]trace.Link, 0, len(evs))
	for _, ev := range evs {
		if ev.Headers == nil {
			continue
		}
		if sc := trace.SpanContextFromContext(w3c.Extract(context.Background(), headerCarrier(ev.Headers))); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	return tracer.Start(ctx, subscriber+" batch",
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithLinks(links...),
		trace.WithAttributes(attribute.Int("fanout.batch_size", len(evs)), attribute.String("fanout.subscriber", subscriber)))
}
