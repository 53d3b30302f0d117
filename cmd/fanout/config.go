package main

import (
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/fanout/fanout/internal/config"
	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/logging"
	"github.com/fanout/fanout/internal/opsserver"
	"github.com/fanout/fanout/internal/tracing"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/shop/demo"
	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/searchindex"
)

// Config is the whole configuration of the fanout binary: the sections of
// the packages its roles run, each declared, defaulted and checked by the
// package that owns it (its struct's field comments state each key's
// default and range), and the rules that tie sections together
// (crossKeyRules). Package config derives the keys, the defaults, the
// environment variables and `fanout config keys` from this struct.
type Config struct {
	Postgres    connect.PostgresConfig `koanf:"postgres"`
	NATS        connect.NATSConfig     `koanf:"nats"`
	Stream      stream.Config          `koanf:"stream"`
	Relay       relay.Config           `koanf:"relay"`
	Subscribers subscribers.Config     `koanf:"subscribers"`
	Redis       connect.RedisConfig    `koanf:"redis"`
	Search      searchindex.Config     `koanf:"search"`
	HTTP        opsserver.Config       `koanf:"http"`
	Tracing     tracing.Config         `koanf:"tracing"`
	Log         logging.Config         `koanf:"log"`
	Demo        demo.Config            `koanf:"demo"`

	// overrides are the settings of the subscribers that set
	// subscribers.<name>.* keys (see Subscriber).
	overrides map[string]subscribers.Config
}

// defaultConfig is every section's defaults.
func defaultConfig() Config {
	return Config{
		Postgres:    connect.DefaultPostgres(),
		NATS:        connect.DefaultNATS(),
		Stream:      stream.DefaultConfig(),
		Relay:       relay.DefaultConfig(),
		Subscribers: subscribers.DefaultConfig(),
		Redis:       connect.DefaultRedis(),
		Search:      searchindex.DefaultConfig(),
		HTTP:        opsserver.DefaultConfig(),
		Tracing:     tracing.DefaultConfig(),
		Log:         logging.DefaultConfig(),
		Demo:        demo.DefaultConfig(),
	}
}

// replacedKeys are keys of earlier versions, with what replaced them: an
// old file or variable is refused with this, not silently ignored.
var replacedKeys = map[string]string{
	"subscribers.max_deliver": "replaced by subscribers.max_failures (handler failures before the dead letters; " +
		"JetStream now redelivers without limit, and deliveries lost to an outage or a crash no longer count) " +
		"and subscribers.max_crashes",
	"http.ready_max_pending_age": "replaced by relay.stall_after: a relay is not ready when it makes no progress, " +
		"no longer when the table holds an old row (one row backing off used to take every relay out of rotation)",
}

// perSubscriber lets each of names set subscribers.OwnKeys for itself, as
// subscribers.<name>.<key>; Load puts their settings in into.
func perSubscriber(names []string, into *map[string]subscribers.Config) config.PerName[subscribers.Config] {
	return config.PerName[subscribers.Config]{Section: "subscribers", Noun: "subscriber", Keys: subscribers.OwnKeys, Names: names, Into: into}
}

// loadConfig builds the configuration from the defaults, the YAML file at
// path (if path is not empty) and the FANOUT_ variables in environ (as
// os.Environ returns them), each subscriber of names taking its own
// subscribers.<name>.* settings, then validates it.
func loadConfig(path string, environ []string, names ...string) (*Config, error) {
	c := defaultConfig()
	if err := config.Load(&c, path, environ, config.Replaced(replacedKeys), perSubscriber(names, &c.overrides)); err != nil {
		return nil, err
	}
	return &c, nil
}

// configKeys are every key of the configuration, sorted, and then those
// that each of names may set for itself.
func configKeys(names ...string) []string {
	return append(config.Keys(defaultConfig()), perSubscriber(names, nil).AllKeys()...)
}

// Validate checks every section, then the rules that tie sections
// together, and returns all problems found, each naming its keys. Each
// subscriber's own settings are checked as a whole, as the shared ones,
// once those hold.
func (c *Config) Validate() error {
	errs := []error{config.ValidateSections(c)}
	for _, rule := range crossKeyRules {
		if msg := rule.check(c); msg != "" {
			errs = append(errs, errors.New(msg))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for _, name := range slices.Sorted(maps.Keys(c.overrides)) {
		one := *c
		one.Subscribers, one.overrides = c.overrides[name], nil
		if err := one.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("with the subscribers.%s.* settings: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// Subscriber returns the settings subscriber name runs with: the shared
// subscribers.* keys, and its own subscribers.<name>.* over them.
func (c *Config) Subscriber(name string) subscribers.Config {
	if o, ok := c.overrides[name]; ok {
		return o
	}
	return c.Subscribers
}

// SetSubscriberStart sets where new consumers start, for every subscriber
// (a command-line flag that outranks the files and the environment).
func (c *Config) SetSubscriberStart(start string) {
	c.Subscribers.Start = start
	for name, o := range c.overrides {
		o.Start = start
		c.overrides[name] = o
	}
}

// Section reads the section key ("redis", "search", ...) into v (see
// config.Section): how a subscriber reads the settings of the services it
// uses (subscribers.Settings).
func (c *Config) Section(key string, v any) error { return config.Section(c, key, v) }

// Redacted is the configuration as a nested map, ready to print, secrets
// redacted (see config.Redacted), with each subscriber's own settings
// under subscribers.<name>.
func (c *Config) Redacted() map[string]any {
	out := config.Redacted(c)
	subs := out["subscribers"].(map[string]any)
	for name, o := range c.overrides {
		all := config.Redacted(o)
		own := map[string]any{}
		for _, k := range subscribers.OwnKeys {
			own[k] = all[k]
		}
		subs[name] = own
	}
	return out
}

// crossKeyRule is one rule tying keys of several sections together. A
// rule over the keys of one section is that section's Validate's.
type crossKeyRule struct {
	// keys are every key the rule involves; its error names them all.
	keys  []string
	check func(*Config) string
}

// crossKeyRules are the settings that are each valid alone, and valid
// with the rest of their section, but cannot work together.
var crossKeyRules = []crossKeyRule{
	{
		// A row whose publish JetStream stored but whose PubAck or mark was
		// lost is published again: after its lease expires and the reaper
		// returns it, or after its retry backoff. The second publish must
		// still fall inside the duplicates window, or the stream stores
		// the event twice.
		keys: []string{"stream.duplicate_window", "relay.lease", "relay.publish_timeout", "relay.reap_interval", "relay.retry_max"},
		check: func(c *Config) string {
			if need := relay.RepublishDelay(c.Relay); c.Stream.DuplicateWindow <= need {
				return fmt.Sprintf("stream.duplicate_window (%s) must be longer than relay.lease (%s) + relay.publish_timeout (%s) + relay.reap_interval (%s) + relay.retry_max (%s) = %s, the longest a row's second publish can follow its first; a shorter window lets the stream store an event twice",
					c.Stream.DuplicateWindow, c.Relay.Lease, c.Relay.PublishTimeout, c.Relay.ReapInterval, c.Relay.RetryMax, need)
			}
			return ""
		},
	},
	{
		// The stream's prefix and the dead letters' must differ: dead
		// letters would otherwise land in the events stream.
		keys: []string{"subscribers.dead_letter_subject_prefix", "stream.subject_prefix"},
		check: func(c *Config) string {
			if c.Subscribers.DeadLetterSubjectPrefix == c.Stream.SubjectPrefix {
				return fmt.Sprintf("subscribers.dead_letter_subject_prefix (%q) must differ from stream.subject_prefix (%q): dead letters would be published as events", c.Subscribers.DeadLetterSubjectPrefix, c.Stream.SubjectPrefix)
			}
			return ""
		},
	},
	{
		keys: []string{"subscribers.dead_letter_stream", "stream.name"},
		check: func(c *Config) string {
			if c.Subscribers.DeadLetterStream == c.Stream.Name {
				return fmt.Sprintf("subscribers.dead_letter_stream (%q) must differ from stream.name (%q)", c.Subscribers.DeadLetterStream, c.Stream.Name)
			}
			return ""
		},
	},
}
