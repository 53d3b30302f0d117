package outbox

import (
	"context"
	"maps"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// w3c is the W3C Trace Context propagator: traceparent and tracestate.
var w3c = propagation.TraceContext{}

// TraceHeaders returns headers plus the W3C trace context of the span in ctx,
// unless the writer already set a traceparent or ctx carries no span. So a
// writer instrumented with OpenTelemetry has its trace continue in every
// subscriber's handling without doing anything.
func TraceHeaders(ctx context.Context, headers map[string]string) map[string]string {
	if _, set := headers["traceparent"]; set || !trace.SpanContextFromContext(ctx).IsValid() {
		return headers
	}
	out := make(map[string]string, len(headers)+2)
	maps.Copy(out, headers)
	w3c.Inject(ctx, propagation.MapCarrier(out))
	return out
}
