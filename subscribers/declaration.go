package subscribers

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strings"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// Declaration is everything fanout knows about a subscriber, and the one
// place each of it is said: enough to run it (New, and its Name,
// EventTypes and Ordered, which the runtime takes from here), to provision
// its consumer (Name, EventTypes), and to derive its deployment (its NATS user and permissions, its Postgres role and grants,
// its compose service and secrets; see `fanout deploy`). A subscriber's
// package declares it; the registry (package subscribers/registry) lists
// the declarations, one line each.
type Declaration struct {
	// Name is the durable consumer's name, the checkpoint's key, the NATS
	// user and the suffix of the Postgres role (fanout_<name>). It must
	// never change: a new name is a new subscriber that starts over.
	Name string
	// EventTypes are the event types wanted, as subject patterns relative
	// to the stream's prefix: "order.created", "product.>", "*.deleted".
	EventTypes []string
	// Uses are the services besides Postgres and NATS (which every
	// subscriber uses) its handler talks to: each is connected before New
	// is called, and gets the subscriber its credentials in deployment.
	Uses []Service
	// Grants are the Postgres privileges its handler needs beyond its own
	// checkpoint and attempts rows, each as in GRANT <grant> TO role, e.g.
	// "SELECT ON orders, order_lines" or "USAGE ON SEQUENCE invoice_seq".
	// Its role gets exactly these: a query outside them is refused.
	Grants []string
	// Tables are the tables its own migrations create (under
	// schema/migrations), e.g. "product_sales": fanout_migrate owns them,
	// and deploy/postgres/roles.sql, rendered from this, grants nothing on
	// a database until they exist (it runs once before `fanout migrate`
	// and once after). Its role's access to them is in Grants. Tables of
	// the writers' domain that it only reads are not listed here.
	Tables []string
	// Ordered: the subscriber applies each aggregate's events in order, one
	// at a time per aggregate (its handler, made by Tx, commits its
	// per-aggregate checkpoint with its effects). Its consumer pins one
	// instance at a time; its role may write its rows of
	// subscriber_aggregates.
	Ordered bool
	// Backfill, if set, is how its state derives from Postgres: `fanout
	// backfill <name>` reads the table it names and hands the handler an
	// event per row (see Backfill). Its role gets SELECT on the table.
	Backfill *Backfill
	// New builds the handler from the connections in deps. It may check
	// or prepare its dependencies (an index, a schema) and fail.
	New func(deps Deps) (Handler, error)
}

// Service is a service a subscriber's handler uses besides Postgres and
// NATS.
type Service string

const (
	// Redis is the cache (redis.*), connected as Deps.Redis.
	Redis Service = "redis"
	// Search is the search engine (search.*), connected as Deps.Search.
	Search Service = "search"
)

// Deps are what a subscriber's handler is built from.
type Deps struct {
	// Context bounds New's own work (checking an index, ...), not the
	// handler's life.
	Context context.Context
	Pool    *pgxpool.Pool
	// Redis is set when the declaration uses Redis; Search when it uses
	// the search engine.
	Redis  *redis.Client
	Search *search.Client
	// Settings reads the settings of the services the subscriber uses
	// (redis.timeout, search.alias, ...); nil when there are none.
	Settings Settings
	Logger   *slog.Logger
	// Metrics registers the subscriber's own metrics; nil when the process
	// serves none (an operator command).
	Metrics prometheus.Registerer
}

// Settings reads one section of the configuration: key is its first key
// ("redis", "search"), v a pointer to a struct whose fields carry koanf
// tags (`koanf:"timeout"`) for the settings wanted. The fanout binary's
// configuration implements it; a program embedding the runtime can too.
type Settings interface {
	Section(key string, v any) error
}

// UsesService reports whether the declaration uses s.
func (d Declaration) UsesService(s Service) bool { return slices.Contains(d.Uses, s) }

// Reads says whether the subscriber's filters take events of eventType.
func (d Declaration) Reads(eventType string) bool {
	return slices.ContainsFunc(d.EventTypes, func(f string) bool { return stream.SubjectMatches(f, eventType) })
}

// nameRE is what a subscriber's name may be: it is a durable consumer's
// name, a NATS user whose inbox prefix must not nest in another's, a
// subject token and part of a Postgres role name.
var nameRE = regexp.MustCompile(`^[a-z][a-z0-9_]{0,40}$`)

// reservedNames are the deployment's other NATS users and accounts
// (deploy/nats/nats-server.conf names an account after each user, in upper
// case, and after each stream): a subscriber called so would share them.
var reservedNames = []string{"relay", "provisioner", "operator", "admin", "admin_deadletter", "events", "deadletter"}

// tableRE is a table name roles.sql can quote without escaping.
var tableRE = regexp.MustCompile(`^[a-z][a-z0-9_]{0,62}$`)

// Validate reports a declaration fanout cannot run or deploy.
func (d Declaration) Validate() error {
	var errs []error
	if !nameRE.MatchString(d.Name) {
		errs = append(errs, fmt.Errorf("name %q: want lower-case letters, digits and _, starting with a letter, at most 41 characters", d.Name))
	}
	if slices.Contains(reservedNames, d.Name) || strings.HasPrefix(d.Name, stream.OperatorConsumerPrefix) || strings.HasPrefix(d.Name, stream.RelayConsumerPrefix) {
		errs = append(errs, fmt.Errorf("name %q is reserved: the deployment has users and accounts called %s, and consumers starting with %q are the operator's, with %q the relay's",
			d.Name, strings.Join(reservedNames, ", "), stream.OperatorConsumerPrefix, stream.RelayConsumerPrefix))
	}
	if len(d.EventTypes) == 0 {
		errs = append(errs, errors.New("no event types"))
	}
	for _, s := range d.Uses {
		if s != Redis && s != Search {
			errs = append(errs, fmt.Errorf("uses unknown service %q (known: %s, %s)", s, Redis, Search))
		}
	}
	for _, t := range d.Tables {
		if !tableRE.MatchString(t) {
			errs = append(errs, fmt.Errorf("table %q: want a lower-case SQL name (letters, digits and _, starting with a letter)", t))
		}
	}
	if d.New == nil {
		errs = append(errs, errors.New("no constructor (New)"))
	}
	if d.Backfill != nil {
		if err := d.Backfill.validate(d.EventTypes, d.Ordered); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("subscriber %q: %w", d.Name, err)
	}
	return nil
}

// AllGrants are its Grants and what its backfill reads (SELECT on the
// backfill's table): what its Postgres role is granted.
func (d Declaration) AllGrants() []string {
	if d.Backfill == nil {
		return slices.Clone(d.Grants)
	}
	return append(slices.Clone(d.Grants), "SELECT ON "+d.Backfill.Table)
}

// Build runs the declaration's constructor and checks that the handler it
// returns is one the declaration can run.
func (d Declaration) Build(deps Deps) (Handler, error) {
	h, err := d.New(deps)
	if err != nil {
		return Handler{}, fmt.Errorf("subscriber %s: %w", d.Name, err)
	}
	if err := d.runs(h); err != nil {
		return Handler{}, err
	}
	return h, nil
}

// runs checks that the declaration can run h: a handler made by Tx or
// Each, and by Tx if the subscriber is ordered.
func (d Declaration) runs(h Handler) error {
	if h.IsZero() {
		return fmt.Errorf("subscriber %s: no handler (make one with subscribers.Tx or subscribers.Each)", d.Name)
	}
	if _, tx := h.TxHandler(); d.Ordered && !tx {
		return fmt.Errorf("subscriber %s is ordered: its handler must be made by subscribers.Tx (its per-aggregate checkpoint commits with its effects)", d.Name)
	}
	return nil
}
