package tracing

import (
	"net/url"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/validate"
)

// Config is OpenTelemetry tracing (the tracing.* keys). The W3C trace
// context always travels from writers to handlers; spans are exported only
// if an exporter is set.
type Config struct {
	// Exporter is none, stdout (spans as JSON on stderr) or otlp (OTLP over
	// HTTP to a collector). Default none.
	Exporter string `koanf:"exporter"`
	// OTLPEndpoint is the collector's full traces URL for exporter otlp,
	// such as http://otel-collector:4318/v1/traces. Empty: the standard
	// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT
	// variable, else http://localhost:4318/v1/traces. Headers (say, an API
	// key) come from OTEL_EXPORTER_OTLP_HEADERS. Default empty.
	OTLPEndpoint string `koanf:"otlp_endpoint"`
}

// DefaultConfig returns the tracing.* defaults.
func DefaultConfig() Config { return Config{Exporter: "none"} }

// Validate checks the tracing.* keys, naming every key that is wrong.
func (c Config) Validate() error {
	var v validate.Errors
	v.OneOf("tracing.exporter", c.Exporter, "none", "stdout", "otlp")
	if c.OTLPEndpoint != "" {
		if u, err := url.Parse(c.OTLPEndpoint); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			v.Bad("tracing.otlp_endpoint", "must be an http:// or https:// URL such as http://otel-collector:4318/v1/traces (got %q)", config.RedactURL(c.OTLPEndpoint))
		}
	}
	return v.Err()
}
