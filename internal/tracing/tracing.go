// Package tracing installs the OpenTelemetry tracer provider a process
// exports its spans with (config key tracing). With no exporter the global
// provider stays the no-op one: spans cost nothing, and the W3C trace
// context still travels from writers to handlers.
package tracing

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/fanout/fanout/internal/config"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// exportTimeout bounds one export request to the collector.
const exportTimeout = 10 * time.Second

// Setup installs the exporter cfg names as the global tracer provider.
// shutdown flushes the spans still buffered (bounded by its ctx) and is
// never nil.
// Export failures (a collector down) go to logger as warnings. Neither
// they nor shutdown's error show the credentials of the OTLP endpoint and
// headers.
func Setup(ctx context.Context, cfg Config, stderr io.Writer, logger *slog.Logger) (shutdown func(context.Context) error, err error) {
	// OpenTelemetry reports what it cannot read in its OTEL_ variables
	// through its own logger, on stderr unless told otherwise, quoting
	// the raw value: a malformed OTEL_EXPORTER_OTLP_HEADERS, API key and
	// all. Its records go to our logger instead, values masked.
	otel.SetLogger(logr.FromSlogHandler(otelHandler{logger.Handler()}))
	var exp sdktrace.SpanExporter
	switch cfg.Exporter {
	case "", "none":
		return func(context.Context) error { return nil }, nil
	case "stdout":
		exp, err = stdouttrace.New(stdouttrace.WithWriter(stderr))
	case "otlp":
		warnUnsentCredentials(cfg, logger)
		opts := []otlptracehttp.Option{otlptracehttp.WithTimeout(exportTimeout)}
		if cfg.OTLPEndpoint != "" {
			opts = append(opts, otlptracehttp.WithEndpointURL(cfg.OTLPEndpoint))
		}
		// New does not connect: an absent collector costs failed exports
		// (logged by OpenTelemetry), never a failed start.
		exp, err = otlptracehttp.New(ctx, opts...)
	default:
		return nil, fmt.Errorf("tracing.exporter: unknown exporter %q", cfg.Exporter)
	}
	secrets := otlpSecrets(cfg)
	if err != nil {
		return nil, fmt.Errorf("tracing.exporter %s: %w", cfg.Exporter, config.RedactError(err, secrets...))
	}
	// A collector's refusal may quote the request, headers included.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		logger.Warn("exporting spans", "exporter", cfg.Exporter, "error", config.RedactError(err, secrets...))
	}))
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(serviceResource()))
	otel.SetTracerProvider(tp)
	return func(ctx context.Context) error { return config.RedactError(tp.Shutdown(ctx), secrets...) }, nil
}

// serviceResource names the service fanout unless OTEL_SERVICE_NAME or
// OTEL_RESOURCE_ATTRIBUTES names it otherwise.
func serviceResource() *resource.Resource {
	if os.Getenv("OTEL_SERVICE_NAME") != "" || strings.Contains(os.Getenv("OTEL_RESOURCE_ATTRIBUTES"), "service.name=") {
		return resource.Default()
	}
	r, err := resource.Merge(resource.Default(), resource.NewSchemaless(attribute.String("service.name", "fanout")))
	if err != nil {
		return resource.Default()
	}
	return r
}

// Where the OTLP exporter takes its endpoint and headers from, besides
// tracing.otlp_endpoint (which wins over both endpoint variables).
const (
	envTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envTracesHeaders  = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
	envHeaders        = "OTEL_EXPORTER_OTLP_HEADERS"
)

// warnUnsentCredentials says when the endpoint in use carries credentials
// in its user info or query: the OTLP exporter sends only the scheme,
// host and path of the URL, so they never reach the collector, whose
// refusals would otherwise be a mystery. Credentials belong in headers.
func warnUnsentCredentials(cfg Config, logger *slog.Logger) {
	source, endpoint := "tracing.otlp_endpoint", cfg.OTLPEndpoint
	for _, env := range []string{envTracesEndpoint, envEndpoint} {
		if endpoint == "" {
			source, endpoint = env, os.Getenv(env)
		}
	}
	u, err := url.Parse(endpoint)
	if endpoint == "" || err != nil || (u.User == nil && u.RawQuery == "") {
		return
	}
	logger.Warn("the OTLP exporter sends neither the user info nor the query of its endpoint URL: give credentials as headers in "+envHeaders,
		"source", source, "endpoint", config.RedactURL(endpoint))
}

// otlpSecrets are the credentials the OTLP exporter may be given: every
// header value (headers exist for credentials: authorization, API keys),
// and those in the endpoints' URLs.
func otlpSecrets(cfg Config) []string {
	secrets := config.URLSecrets(cfg.OTLPEndpoint)
	for _, env := range []string{envTracesEndpoint, envEndpoint} {
		secrets = append(secrets, config.URLSecrets(os.Getenv(env))...)
	}
	for _, env := range []string{envTracesHeaders, envHeaders} {
		for _, h := range strings.Split(os.Getenv(env), ",") {
			// name=value, the value URL-encoded; a malformed entry
			// (name: value) is secret whole, and after its colon.
			name, value, ok := strings.Cut(h, "=")
			if !ok {
				_, value, _ = strings.Cut(name, ":")
				secrets = append(secrets, strings.TrimSpace(h))
			}
			value = strings.TrimSpace(value)
			secrets = append(secrets, value)
			if d, err := url.PathUnescape(value); err == nil {
				secrets = append(secrets, d)
				// The credential of "Bearer <token>", "Basic <base64>".
				if f := strings.Fields(d); len(f) > 1 {
					secrets = append(secrets, f[len(f)-1])
				}
			}
		}
	}
	return secrets
}

// otelHandler passes OpenTelemetry's own log records on, with every
// value it quotes masked: those are raw OTEL_ variables. URLs keep what is
// not a credential (RedactURL); other strings are masked whole, file
// paths excepted. Its "err" attribute is our "error".
type otelHandler struct{ slog.Handler }

func (h otelHandler) Handle(ctx context.Context, r slog.Record) error {
	out := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	r.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(redactOTelAttr(a))
		return true
	})
	return h.Handler.Handle(ctx, out)
}

func (h otelHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	red := make([]slog.Attr, len(attrs))
	for i, a := range attrs {
		red[i] = redactOTelAttr(a)
	}
	return otelHandler{h.Handler.WithAttrs(red)}
}

func (h otelHandler) WithGroup(name string) slog.Handler {
	return otelHandler{h.Handler.WithGroup(name)}
}

func redactOTelAttr(a slog.Attr) slog.Attr {
	v := a.Value.Resolve()
	if a.Key == "err" {
		a.Key = "error"
	}
	switch v.Kind() {
	case slog.KindGroup:
		attrs := v.Group()
		red := make([]any, len(attrs))
		for i, g := range attrs {
			red[i] = redactOTelAttr(g)
		}
		return slog.Group(a.Key, red...)
	case slog.KindString:
		switch s := v.String(); {
		case s == "" || a.Key == "file":
			return slog.String(a.Key, s)
		case strings.Contains(s, "://"):
			return slog.String(a.Key, config.RedactURL(s))
		default:
			return slog.String(a.Key, config.Mask)
		}
	case slog.KindAny:
		if err, ok := v.Any().(error); ok {
			return slog.String(a.Key, config.RedactText(err.Error()))
		}
		return slog.String(a.Key, config.Mask)
	default:
		return slog.Attr{Key: a.Key, Value: v}
	}
}
