package relay

import (
	"context"
	"time"

	"github.com/fanout/fanout/outbox"
	"github.com/jackc/pgx/v5"
)

// listener wakes the poll relay's claim loop when a writer commits: the
// outbox's insert sends a NOTIFY (throttled per writer process), and a
// lost one costs at most relay.poll_interval.
type listener struct{ *core }

// run holds a dedicated connection LISTENing for writers' wake-ups, and
// reconnects when it breaks. Every (re)connect also nudges the claimer,
// since rows may have committed while nobody listened.
func (l *listener) run(ctx context.Context) {
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := l.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		l.logger.Warn("wake-up listener lost its connection; polling covers the gap", "error", err, "reconnect_in", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(wait*2, 5*time.Second)
	}
}

func (l *listener) listenOnce(ctx context.Context) error {
	cc := l.pool.Config().ConnConfig.Copy()
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return err
	}
	defer func() {
		closeCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(closeCtx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{outbox.WakeChannel}.Sanitize()); err != nil {
		return err
	}
	l.nudge()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		l.nudge()
	}
}
