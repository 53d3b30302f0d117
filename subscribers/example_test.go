package subscribers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/signal"

	"github.com/fanout/fanout/stream"
	"github.com/fanout/fanout/subscribers"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
)

// auditLog is a subscriber of another program: it writes each order it
// sees to a table of its own, in the transaction that records its
// checkpoint, so each order is written once however often it arrives.
type auditLog struct{}

// auditLogSubscriber declares it: its name (its consumer's and its
// checkpoint's), the events it takes, and its handler.
var auditLogSubscriber = subscribers.Declaration{
	Name:       "audit_log",
	EventTypes: []string{"order.created"},
	New:        func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Tx(auditLog{}), nil },
}

func (auditLog) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	var p struct {
		OrderID int64 `json:"order_id"`
	}
	if err := json.Unmarshal(ev.Payload, &p); err != nil || p.OrderID <= 0 {
		return subscribers.Permanent(fmt.Errorf("malformed order.created payload: %.100q", ev.Payload))
	}
	_, err := tx.Exec(ctx, `INSERT INTO audit_log (order_id, event_id) VALUES ($1, $2)`, p.OrderID, ev.ID)
	return err
}

// The subscriber runtime embedded in another Go program, with its own
// settings (subscribers.Config) and the stream's (stream.Config).
func ExampleNew() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, "postgres://app@127.0.0.1:5432/shop")
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		panic(err)
	}
	defer nc.Close()

	cfg := subscribers.DefaultConfig()
	cfg.Concurrency = 8
	if err := cfg.Validate(); err != nil {
		panic(err) // names the key: "subscribers.concurrency must be between 1 and 256 (got 0)"
	}
	h, err := auditLogSubscriber.Build(subscribers.Deps{Context: ctx, Pool: pool, Logger: slog.Default()})
	if err != nil {
		panic(err)
	}
	r, err := subscribers.New(subscribers.Options{Declaration: auditLogSubscriber, Handler: h, Config: cfg, Stream: stream.DefaultConfig(),
		Pool: pool, Conn: nc, Logger: slog.Default()})
	if err != nil {
		panic(err)
	}
	if err := r.Start(ctx); err != nil {
		panic(err)
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	_ = r.Stop(sctx) // the events in hand finish and are acked
}
