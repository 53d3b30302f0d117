package benchkit

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSURL and AdminURL are every benchmark's -nats and -postgres flags.
var (
	NATSURL  = flag.String("nats", connect.DefaultNATSURL, "nats-server URL")
	AdminURL = flag.String("postgres", pgtest.AdminURL(), "superuser URL to create the benchmark databases")
)

// Main parses the flags, checks -runs and runs run; an error ends the
// program with status 1.
func Main(run func(context.Context) error) {
	flag.Parse()
	err := CheckRuns()
	if err == nil {
		err = run(context.Background())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// Suffix is a random word that makes a run's stream names its own, so
// that runs side by side (or one that died before its cleanup) do not
// meet.
func Suffix() string { return strconv.FormatUint(rand.Uint64()%1_000_000_000, 36) }

// Pipeline is what a subscriber benchmark runs on: a fresh database with a
// pool on it, a connection to -nats, and a stream and a dead-letter stream
// of the run's own, which Close deletes.
type Pipeline struct {
	Config  *Config
	DB      *pgtest.DB
	Pool    *pgxpool.Pool
	NC      *nats.Conn
	JS      jetstream.JetStream
	Suffix  string // of the streams' names
	closers []func()
}

// Open makes a Pipeline whose pool has maxConns connections and whose
// streams are named after name: "SUB" gives BENCHSUB_<suffix> (subjects
// benchsub<suffix>) and BENCHSUB_DLQ_<suffix> (benchsubdlq<suffix>).
func Open(ctx context.Context, name string, maxConns int32) (_ *Pipeline, err error) {
	p := &Pipeline{Config: DefaultConfig(), Suffix: Suffix()}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	upper, lower := "BENCH"+name, "bench"+strings.ToLower(name)
	p.Config.Stream.Name, p.Config.Stream.SubjectPrefix = upper+"_"+p.Suffix, lower+p.Suffix
	p.Config.Subscribers.DeadLetterStream, p.Config.Subscribers.DeadLetterSubjectPrefix = upper+"_DLQ_"+p.Suffix, lower+"dlq"+p.Suffix
	if p.NC, err = nats.Connect(*NATSURL); err != nil {
		return nil, fmt.Errorf("connect to nats (start the services: go tool task services): %w", err)
	}
	p.closers = append(p.closers, p.NC.Close)
	if p.JS, err = jetstream.New(p.NC); err != nil {
		return nil, err
	}
	p.closers = append(p.closers, func() {
		_ = p.JS.DeleteStream(context.Background(), p.Config.Stream.Name)
		_ = p.JS.DeleteStream(context.Background(), p.Config.Subscribers.DeadLetterStream)
	})
	if p.DB, err = pgtest.Create(ctx, *AdminURL); err != nil {
		return nil, err
	}
	p.closers = append(p.closers, p.DB.Close)
	pc, err := pgxpool.ParseConfig(p.DB.URL)
	if err != nil {
		return nil, err
	}
	pc.MaxConns = maxConns
	if p.Pool, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
		return nil, err
	}
	p.closers = append(p.closers, p.Pool.Close)
	return p, nil
}

// Close undoes Open, the pool first and the NATS connection last.
func (p *Pipeline) Close() {
	for _, f := range slices.Backward(p.closers) {
		f()
	}
}

// StartRelay makes a relay of opts and starts it. The caller stops it.
func StartRelay(ctx context.Context, opts relay.Options) (*relay.Relay, error) {
	r, err := relay.New(opts)
	if err != nil {
		return nil, err
	}
	return r, r.Start(ctx)
}

// StartRelay starts a relay of the pipeline's settings, observed by obs
// (nil: none). The caller stops it.
func (p *Pipeline) StartRelay(ctx context.Context, obs relay.Observer) (*relay.Relay, error) {
	return StartRelay(ctx, relay.Options{Relay: p.Config.Relay, Stream: p.Config.Stream, Pool: p.Pool, Conn: p.NC, Logger: Quiet, Observer: obs})
}

// StartRunner starts a subscriber of opts (its declaration, handler,
// config and observer) on the pipeline's stream, pool and connection. The
// caller stops it.
func (p *Pipeline) StartRunner(ctx context.Context, opts subscribers.Options) (*subscribers.Runner, error) {
	opts.Stream, opts.Pool, opts.Conn, opts.Logger = p.Config.Stream, p.Pool, p.NC, Quiet
	r, err := subscribers.New(opts)
	if err != nil {
		return nil, err
	}
	return r, r.Start(ctx)
}

// Publish runs a relay until every outbox row is sent.
func (p *Pipeline) Publish(ctx context.Context) error {
	r, err := p.StartRelay(ctx, nil)
	if err != nil {
		return err
	}
	defer r.Stop(ctx) //nolint:errcheck
	return p.WaitSent(ctx, 0)
}

// WaitSent waits until no outbox row is left unsent, for at most limit (0:
// as long as it takes).
func (p *Pipeline) WaitSent(ctx context.Context, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		unsent, err := outboxstore.New(p.Pool).Unsent(ctx, nil)
		if err != nil || unsent == 0 {
			return err
		}
		if limit > 0 && time.Now().After(deadline) {
			return fmt.Errorf("%d outbox rows unsent after %s", unsent, limit)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Reset has the next run of the subscriber named consumer start from the
// stream's first event, on a settled database: it deletes the consumer,
// settles the database, then empties tables.
//
// Settled before the truncate, not after: without statistics on the rows
// the setup wrote, the planner may scan order_lines once per batch (5x
// slower) until autovacuum happens to analyze it mid-run, and the last
// run's dirty pages would be written during this one. But an empty table
// analyzed as empty (reltuples 0) makes every foreign-key check of
// invoice_lines scan invoices, a plan each connection keeps until
// autovacuum (a minute apart) analyzes the growing table: bench:subscribers'
// 1-instance figure then read 9k events/s in one round and 25k in the
// next. Truncated after, the tables have no statistics (reltuples -1) and
// the planner assumes a table of some size, as on a fresh install.
func (p *Pipeline) Reset(ctx context.Context, consumer string, tables ...string) error {
	err := p.JS.DeleteConsumer(ctx, p.Config.Stream.Name, consumer)
	if err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return err
	}
	if err := Settle(ctx, p.Pool); err != nil {
		return err
	}
	if len(tables) > 0 {
		_, err = p.Pool.Exec(ctx, "TRUNCATE "+strings.Join(tables, ", "))
	}
	return err
}

// TimeDrain runs instances subscribers of opts, each with a handler of
// its own (newHandler's) on a NATS connection of its own, as processes
// would be, and returns the time from their start until the consumer has
// nothing pending and nothing unacknowledged (15 minutes at most). They
// are stopped before it returns.
func (p *Pipeline) TimeDrain(ctx context.Context, instances int, opts subscribers.Options, newHandler func() subscribers.Handler) (time.Duration, error) {
	var runners []*subscribers.Runner
	var conns []*nats.Conn
	defer func() {
		for _, r := range runners {
			_ = r.Stop(ctx)
		}
		for _, nc := range conns { // after the runners have drained on them
			nc.Close()
		}
	}()
	opts.Stream, opts.Pool, opts.Logger = p.Config.Stream, p.Pool, Quiet
	for range instances {
		nc, err := nats.Connect(*NATSURL)
		if err != nil {
			return 0, err
		}
		conns = append(conns, nc)
		opts.Conn, opts.Handler = nc, newHandler()
		r, err := subscribers.New(opts)
		if err != nil {
			return 0, err
		}
		runners = append(runners, r)
	}
	start := time.Now()
	for _, r := range runners {
		if err := r.Start(ctx); err != nil {
			return 0, err
		}
	}
	err := p.WaitDrained(ctx, opts.Declaration.Name, 15*time.Minute)
	return time.Since(start), err
}

// WaitDrained waits until the subscriber's consumer has received and acked
// everything (and acked at least one event), for at most limit.
func (p *Pipeline) WaitDrained(ctx context.Context, name string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		time.Sleep(50 * time.Millisecond)
		c, err := p.JS.Consumer(ctx, p.Config.Stream.Name, name)
		if err != nil {
			return err
		}
		info, err := c.Info(ctx)
		if err != nil {
			return err
		}
		if info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not drained after %s: %d pending, %d ack pending", name, limit, info.NumPending, info.NumAckPending)
		}
	}
}

// CheckCheckpointed fails unless the subscriber named name checkpointed
// want events.
func (p *Pipeline) CheckCheckpointed(ctx context.Context, name string, want int) error {
	var done int
	if err := p.Pool.QueryRow(ctx, `SELECT count(*) FROM processed_events WHERE subscriber = $1`, name).Scan(&done); err != nil {
		return err
	}
	if done != want {
		return fmt.Errorf("%d events checkpointed, want %d", done, want)
	}
	return nil
}
