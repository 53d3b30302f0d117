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
	"os"
	"strings"
	"time"

	"github.com/fanout/fanout/internal/config"
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
// Export failures (a collector down) go to logger as warnings.
func Setup(ctx context.Context, cfg config.Tracing, stderr io.Writer, logger *slog.Logger) (shutdown func(context.Context) error, err error) {
	var exp sdktrace.SpanExporter
	switch cfg.Exporter {
	case "", "none":
		return func(context.Context) error { return nil }, nil
	case "stdout":
		exp, err = stdouttrace.New(stdouttrace.WithWriter(stderr))
	case "otlp":
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
	if err != nil {
		return nil, fmt.Errorf("tracing.exporter %s: %w", cfg.Exporter, err)
	}
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		logger.Warn("exporting spans", "exporter", cfg.Exporter, "error", err)
	}))
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(serviceResource()))
	otel.SetTracerProvider(tp)
	return tp.Shutdown, nil
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
