package logging

import "github.com/fanout/fanout/internal/validate"

// Config is the process log (the log.* keys).
type Config struct {
	// Level is debug, info, warn or error. Default info.
	Level string `koanf:"level"`
	// Format is json, text, or auto (text on a terminal, else json). Default auto.
	Format string `koanf:"format"`
}

// DefaultConfig returns the log.* defaults.
func DefaultConfig() Config { return Config{Level: "info", Format: "auto"} }

// Validate checks the log.* keys, naming every key that is wrong.
func (c Config) Validate() error {
	var v validate.Errors
	v.OneOf("log.level", c.Level, "debug", "info", "warn", "error")
	v.OneOf("log.format", c.Format, "auto", "json", "text")
	return v.Err()
}
