package outbox

import "context"

type headersKey struct{}

// WithHeaders returns a context carrying headers (for example a W3C
// "traceparent") for the events written under it; writers pass
// HeadersFromContext(ctx) as Event.Headers.
func WithHeaders(ctx context.Context, headers map[string]string) context.Context {
	return context.WithValue(ctx, headersKey{}, headers)
}

// HeadersFromContext returns the headers set by WithHeaders, or nil.
func HeadersFromContext(ctx context.Context) map[string]string {
	h, _ := ctx.Value(headersKey{}).(map[string]string)
	return h
}
