package demo

import (
	"time"

	"github.com/fanout/fanout/internal/validate"
)

// Config drives the demo writer of `fanout up` and `fanout demo` (the
// demo.* keys).
type Config struct {
	// Rate is writes per second. Default 50, 1..100000.
	Rate int `koanf:"rate"`
	// Products seeded when the catalog is empty. Default 1000, 1..10000000.
	Products int `koanf:"products"`
	// ProgressInterval is how often a progress line is printed. Default 5s, > 0.
	ProgressInterval time.Duration `koanf:"progress_interval"`
}

// DefaultConfig returns the demo.* defaults.
func DefaultConfig() Config {
	return Config{Rate: 50, Products: 1000, ProgressInterval: 5 * time.Second}
}

// Validate checks the demo.* keys, naming every key that is wrong.
func (c Config) Validate() error {
	var v validate.Errors
	v.Between("demo.rate", int64(c.Rate), 1, 100000)
	v.Between("demo.products", int64(c.Products), 1, 10000000)
	v.Positive("demo.progress_interval", c.ProgressInterval)
	return v.Err()
}
