package search

import (
	"context"
	"fmt"
	"strings"

	"github.com/fanout/fanout/internal/config"
)

// Connect opens a client and checks that the engine answers. Errors name
// the engine and its addresses with every credential redacted.
func Connect(ctx context.Context, cfg Config) (*Client, error) {
	c, err := New(cfg)
	if err != nil {
		return nil, config.RedactError(err, secrets(cfg)...)
	}
	if _, err := c.Info(ctx); err != nil {
		return nil, fmt.Errorf("connect to %s at %s: %w", cfg.Engine, config.RedactURL(strings.Join(cfg.Addresses, ",")), config.RedactError(err, secrets(cfg)...))
	}
	return c, nil
}

// secrets reads the addresses as the one search.url they came from, so
// that a password with a ',' (which split it) is still found whole.
func secrets(cfg Config) []string {
	return append(config.URLSecrets(strings.Join(cfg.Addresses, ",")), cfg.Password)
}
