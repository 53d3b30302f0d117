package deploy_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A replay as the rendered Postgres roles allow it (issue 47, item 2): the
// operator requests it, recorded with its role; only the subscriber it
// names takes and finishes it, once; no other subscriber, nor the relay,
// can take it, record its outcome or write the table. (The NATS side, in
// which the operator holds no reset of any subscriber's consumer, is in
// TestRedTeamReaderConsumers and TestNATSPermissions.)
func TestReplaysAreRequestedByTheOperatorAndCarriedOutByTheSubscriber(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := loadConfig(t)
	db := pgtest.NewDB(t)
	applyRoles(t, db.URL)

	operator := bookkeeping.NewReplays(rolePool(t, cfg, db.URL, "fanout_operator"))
	id, err := operator.Request(ctx, bookkeeping.ReplayRequest{Subscriber: "invoicing", Stream: "EVENTS", FromSeq: 3, Within: time.Minute, Reason: "fill a gap"})
	if err != nil {
		t.Fatalf("fanout_operator requests a replay: %v", err)
	}
	var by string
	if err := db.Pool.QueryRow(ctx, `SELECT actor FROM replays WHERE id = $1`, id).Scan(&by); err != nil || by != "fanout_operator" {
		t.Errorf("the request's role: %q (%v), want fanout_operator", by, err)
	}

	refusedCode := func(who, what string, err error, code string) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != code {
			t.Errorf("%s %s: %v, want SQLSTATE %s", who, what, err, code)
			return
		}
		t.Logf("refused: %-18s %s (%s)", who, what, pgErr.Message)
	}
	// The operator asks; as a member of every subscriber role (for
	// redrives) it could otherwise record an outcome of its own.
	for _, role := range []string{"fanout_salesledger", "fanout_cacheinval", "fanout_relay", "fanout_operator"} {
		pool := rolePool(t, cfg, db.URL, role)
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, _, err := bookkeeping.NewReplays(tx).Take(ctx, "invoicing")
			return err
		})
		refusedCode(role, "takes invoicing's replay", err, "42501")
		err = bookkeeping.NewReplays(pool).Finish(ctx, id, bookkeeping.ReplayMoved)
		refusedCode(role, "records invoicing's replay moved", err, "42501")
		denied(t, pool, role, `INSERT INTO replays (subscriber, stream, from_seq, outcome, actor, request_id) VALUES ('invoicing', 'EVENTS', 3, 'moved', 'fanout_invoicing', $1)`, id)
		if role != "fanout_operator" {
			_, err = bookkeeping.NewReplays(pool).Request(ctx, bookkeeping.ReplayRequest{Subscriber: "invoicing", Stream: "EVENTS", FromSeq: 1_000_000, Within: time.Minute})
			refusedCode(role, "requests a replay", err, "42501")
		}
	}
	// salesledger's own requests: none, and invoicing's are not its own.
	sales := rolePool(t, cfg, db.URL, "fanout_salesledger")
	err = pgx.BeginFunc(ctx, sales, func(tx pgx.Tx) error {
		if _, ok, err := bookkeeping.NewReplays(tx).Take(ctx, "salesledger"); err != nil || ok {
			t.Errorf("salesledger takes a replay of its own: %t, %v; want none", ok, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	invoicing := rolePool(t, cfg, db.URL, "fanout_invoicing")
	err = pgx.BeginFunc(ctx, invoicing, func(tx pgx.Tx) error {
		rs := bookkeeping.NewReplays(tx)
		got, ok, err := rs.Take(ctx, "invoicing")
		if err != nil || !ok {
			return errors.Join(err, errors.New("nothing taken"))
		}
		if got.ID != id || got.FromSeq != 3 || got.Stream != "EVENTS" || got.RequestedBy != "fanout_operator" || got.Reason != "fill a gap" {
			t.Errorf("invoicing took %+v, want request %d from fanout_operator", got, id)
		}
		return rs.Finish(ctx, id, bookkeeping.ReplayMoved)
	})
	if err != nil {
		t.Fatalf("fanout_invoicing carries out its replay: %v", err)
	}
	if o, err := operator.Outcome(ctx, id); err != nil || o != (bookkeeping.ReplayOutcome{Outcome: bookkeeping.ReplayMoved, Actor: "fanout_invoicing"}) {
		t.Errorf("the outcome the operator reads: %+v (%v), want moved by fanout_invoicing", o, err)
	}
	// fanout status reads them as the operator.
	if recent, err := operator.Recent(ctx, time.Now().Add(-time.Hour), 10); err != nil || len(recent) != 1 || recent[0].Outcome != bookkeeping.ReplayMoved || recent[0].By != "fanout_invoicing" {
		t.Errorf("the replays fanout_operator reads: %+v (%v), want the one moved by fanout_invoicing", recent, err)
	}
	refusedCode("fanout_invoicing", "records a second outcome", bookkeeping.NewReplays(invoicing).Finish(ctx, id, "failed: twice"), "23505")
	denied(t, invoicing, "fanout_invoicing", `INSERT INTO replays (subscriber, stream, from_seq, outcome, actor) VALUES ('invoicing', 'EVENTS', 1, 'requested', 'fanout_operator')`)
	refusedCode("fanout_invoicing", "requests a replay", func() error {
		_, err := bookkeeping.NewReplays(invoicing).Request(ctx, bookkeeping.ReplayRequest{Subscriber: "invoicing", Stream: "EVENTS", FromSeq: 1_000_000, Within: time.Minute})
		return err
	}(), "42501")
}
