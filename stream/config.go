package stream

import (
	"strings"
	"time"

	"github.com/fanout/fanout/internal/validate"
)

// Config is the JetStream stream that carries the events (the stream.*
// keys): the relay publishes into it, the subscribers read it.
type Config struct {
	// Name of the stream. Default "EVENTS".
	Name string `koanf:"name"`
	// SubjectPrefix is the first subject token: events go to
	// <prefix>.<event_type>. Default "events".
	SubjectPrefix string `koanf:"subject_prefix"`
	// Replicas is 1 on one server, 3 in a cluster. Default 1, 1..5.
	Replicas int `koanf:"replicas"`
	// MaxAge is how long events stay, so a new subscriber can replay history.
	// Default 168h (7 days), > 0.
	MaxAge time.Duration `koanf:"max_age"`
	// MaxBytes caps the stream's size; -1 is unlimited. Default -1.
	MaxBytes int64 `koanf:"max_bytes"`
	// DuplicateWindow is how long JetStream remembers Nats-Msg-Ids. It must
	// exceed relay.RepublishDelay of the relay's settings (the longest a row's
	// second publish can follow its first), and not exceed MaxAge.
	// Default 10m.
	DuplicateWindow time.Duration `koanf:"duplicate_window"`
	// Provision is auto (the relay creates the stream or brings it to this
	// configuration, never lowering a limit, and each subscriber its
	// consumer), verify (they refuse to start unless the stream, or the
	// consumer, exists and fits: `fanout provision` made them), or off
	// (trust other tooling). Default auto.
	Provision string `koanf:"provision"`
	// CheckInterval is how often the relay and each subscriber compare the
	// live streams and consumers they depend on with this configuration
	// (unless Provision is off): a difference in any setting that changes
	// delivery makes the role not ready, is logged with both values and
	// counted in fanout_relay_config_differences or
	// fanout_subscriber_config_differences. Default 1m, > 0.
	CheckInterval time.Duration `koanf:"check_interval"`
	// Databases is one (the stream carries one database's events: it
	// records that database as its owner, in metadata OwnerKey, and a
	// relay of another database refuses to publish into it) or several (a
	// stream shared on purpose; every event's identity carries its
	// database either way). Default one.
	Databases string `koanf:"databases"`
	// Database is the owner `fanout provision` records, as a relay prints
	// its database ("<system identifier>/<database>"; fanout status shows
	// it). Empty: the relay with stream.provision auto records its own, and
	// provision records none (the relay then takes the stream's newest
	// event's database for its owner).
	Database string `koanf:"database"`
}

// Defaults.
const (
	DefaultName          = "EVENTS"
	DefaultSubjectPrefix = "events"
)

// DefaultConfig returns the stream's defaults.
func DefaultConfig() Config {
	return Config{Name: DefaultName, SubjectPrefix: DefaultSubjectPrefix, Replicas: 1, MaxAge: 168 * time.Hour,
		MaxBytes: -1, DuplicateWindow: 10 * time.Minute, Provision: "auto", CheckInterval: time.Minute, Databases: "one"}
}

// Validate checks the stream.* keys, alone and together, naming each key
// that is wrong. The rule that ties stream.duplicate_window to the
// relay's settings is checked where the sections are put together.
func (s Config) Validate() error {
	var v validate.Errors
	if !ValidName(s.Name) {
		v.Bad("stream.name", "must be a non-empty name without spaces, '.', '*', '>' or path separators (got %q)", s.Name)
	}
	if !ValidSubjectToken(s.SubjectPrefix) {
		v.Bad("stream.subject_prefix", "must be one subject token without '.', '*', '>' or spaces (got %q)", s.SubjectPrefix)
	}
	v.Between("stream.replicas", int64(s.Replicas), 1, 5)
	v.Positive("stream.max_age", s.MaxAge)
	if s.MaxBytes == 0 || s.MaxBytes < -1 {
		v.Bad("stream.max_bytes", "must be -1 (unlimited) or a positive byte count (got %d)", s.MaxBytes)
	}
	v.Positive("stream.duplicate_window", s.DuplicateWindow)
	if s.MaxAge > 0 && s.DuplicateWindow > s.MaxAge {
		// JetStream refuses a duplicates window longer than the max age.
		v.Bad("stream.duplicate_window", "(%s) must not be longer than stream.max_age (%s): JetStream refuses such a stream", s.DuplicateWindow, s.MaxAge)
	}
	v.OneOf("stream.provision", s.Provision, "auto", "verify", "off")
	v.Positive("stream.check_interval", s.CheckInterval)
	v.OneOf("stream.databases", s.Databases, "one", SeveralDatabases)
	if s.Database != "" && !validDatabase(s.Database) {
		v.Bad("stream.database", "must be <system identifier>/<database> as fanout status prints it (got %q)", s.Database)
	}
	return v.Err()
}

// ValidName reports whether s can name a JetStream stream.
func ValidName(s string) bool {
	return ValidSubjectToken(s) && !strings.ContainsAny(s, `/\`)
}
