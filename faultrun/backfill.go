package faultrun

// Subscribers that join the run late (Options.Backfill): each one's
// consumer takes only the events published after it exists, and `fanout
// backfill` hands it the rest from Postgres, under the same kills and
// outages as every role. The checks then hold it to everything committed,
// as if it had been there from the start: its state equals what Postgres
// says (for invoicing, exactly one invoice per order: nothing lost or
// applied twice; for orderstatus, every order at its latest status and
// version: nothing lost or regressed).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fanout/fanout/subscribers/invoicing"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// lateSubscriber is the state of one of Options.Backfill.
type lateSubscriber struct {
	name  string
	roles []*Role // its subscribe processes, then its backfill
	// joinedAt is when its processes started; zero if they never did.
	joinedAt time.Time
	// firstSeq is the first stream sequence its consumer delivers: the
	// events before it are the backfill's to make up for.
	firstSeq uint64
	rand     *seeded // when its backfill is killed
}

// prepareLate makes the late subscriber's n subscribe processes (taking
// only new events) and its backfill process, not started yet.
func (r *run) prepareLate(env []string, name string, n int) {
	late := &lateSubscriber{name: name, rand: newSeeded(r.o.Seed, 7+uint64(len(r.late)))}
	r.late = append(r.late, late)
	var specs [][]string
	for i := range n {
		specs = append(specs, []string{name + "-" + strconv.Itoa(i+1), "subscribe", name, "--start", "new"})
	}
	// Slow, so that it runs for seconds beside the live events, and its
	// kills land mid-chunk.
	specs = append(specs, []string{"backfill-" + name, "backfill", name, "--chunk", "5", "--rate", "25"})
	for _, spec := range specs {
		role, err := newRole(spec[0], r.o.Binary, r.logDir, r.asUser(env, spec), spec[1:]...)
		if err != nil {
			r.t.Fatal(err)
		}
		late.roles = append(late.roles, role)
	}
}

// joinLate starts the late subscribers at a third of the load, each
// one's backfill once its consumer exists.
func (r *run) joinLate(ctx context.Context) {
	if len(r.late) == 0 {
		return
	}
	sleepCtx(ctx, r.o.Duration/3)
	if ctx.Err() != nil {
		return
	}
	var wg sync.WaitGroup
	for _, late := range r.late {
		wg.Go(func() { r.join(ctx, late) })
	}
	wg.Wait()
}

// join starts late's processes, then its backfill, and kills the backfill
// again and again until it finishes.
func (r *run) join(ctx context.Context, late *lateSubscriber) {
	subscribers, backfill := late.roles[:len(late.roles)-1], late.roles[len(late.roles)-1]
	late.joinedAt = time.Now()
	r.startLate(subscribers...)
	// Its processes make its consumer once they reach NATS and Postgres;
	// one that found either down at its start exits, and is started again
	// here, as a supervisor would.
	var info *jetstream.ConsumerInfo
	for info == nil {
		ictx, cancel := context.WithTimeout(ctx, 3*time.Second)
		c, err := r.js.Consumer(ictx, "EVENTS", late.name)
		if err == nil {
			info, err = c.Info(ictx)
		}
		cancel()
		if info != nil {
			break
		}
		if ctx.Err() != nil {
			// Joined after the load: its processes make the consumer from
			// the first event, and the checks hold it to every event.
			r.o.Logf("chaos: %s did not make its consumer before the load ended (%v): it joins now, from the first event", late.name, err)
			for _, role := range subscribers {
				role.SetArgs("subscribe", late.name)
				role.Kill()
			}
			r.startLate(backfill)
			return
		}
		for _, role := range subscribers {
			if !role.Alive() {
				if err := role.Start(); err != nil {
					r.o.Logf("chaos: restart %s: %v", role.Name, err)
				}
			}
		}
		sleepCtx(ctx, time.Second)
	}
	// A consumer that takes new events starts after the stream's last
	// sequence when it was made; one provisioned earlier (a cluster run's
	// provisioner makes every consumer up front) takes them all.
	late.firstSeq = info.Delivered.Stream + 1
	if info.Config.DeliverPolicy != jetstream.DeliverNewPolicy {
		late.firstSeq = 0
	}
	// Its consumer exists: a process that has to make it again (the
	// stores' rollback can take it away) makes it from the first event, as
	// an operator would once the subscriber has joined.
	for _, role := range subscribers {
		role.SetArgs("subscribe", late.name)
	}
	r.o.Logf("chaos: %s joined; its consumer starts at stream sequence %d; backfill started", late.name, late.firstSeq)
	r.startLate(backfill)
	// Killed and restarted until it finishes, beside the run's faults.
	for ctx.Err() == nil {
		sleepCtx(ctx, late.rand.between(500*time.Millisecond, 2*time.Second))
		if done, _ := r.backfillDone(ctx, late); done || ctx.Err() != nil {
			return
		}
		backfill.Kill()
		r.countFault("backfill process killed (kill -9) and restarted")
		time.Sleep(late.rand.between(100*time.Millisecond, time.Second))
		if err := backfill.Start(); err != nil {
			r.o.Logf("chaos: restart %s: %v", backfill.Name, err)
		}
	}
}

// rejoinLate restarts the late subscribers' processes after the stores'
// rollback, those that had joined: a rollback to a copy from before one
// joined takes its consumer away, and a running subscriber does not make
// its consumer again (an orchestrator restarts it when its readiness names
// the missing consumer; here, this).
func (r *run) rejoinLate() {
	var subscribers []*Role
	for _, late := range r.late {
		subscribers = append(subscribers, late.roles[:len(late.roles)-1]...) // the last is the backfill
	}
	r.rolesMu.Lock()
	var joined []*Role
	for _, role := range r.roles {
		if slices.Contains(subscribers, role) {
			joined = append(joined, role)
		}
	}
	r.rolesMu.Unlock()
	for _, role := range joined {
		if err := role.Restart(); err != nil {
			r.o.Logf("chaos: restart %s: %v", role.Name, err)
		}
	}
}

func (r *run) startLate(roles ...*Role) {
	for _, role := range roles {
		if err := role.Start(); err != nil {
			r.t.Errorf("chaos: start %s: %v", role.Name, err)
		}
	}
	r.rolesMu.Lock()
	r.roles = append(r.roles, roles...)
	r.rolesMu.Unlock()
}

// missedByLate reports whether subscriber joined late and its consumer
// never delivers the event at stream sequence seq.
func (r *run) missedByLate(subscriber string, seq uint64) bool {
	for _, late := range r.late {
		if late.name == subscriber {
			return seq < late.firstSeq
		}
	}
	return false
}

// backfillsDone reports whether every late subscriber's backfill has
// finished (the drain waits for them), and if not, why.
func (r *run) backfillsDone(ctx context.Context) (bool, string) {
	for _, late := range r.late {
		if done, why := r.backfillDone(ctx, late); !done {
			return false, why
		}
	}
	return true, ""
}

// backfillDone reports whether late's backfill has finished, and if not,
// why.
func (r *run) backfillDone(ctx context.Context, late *lateSubscriber) (bool, string) {
	if late.joinedAt.IsZero() {
		return true, ""
	}
	var finished bool
	err := r.pool().QueryRow(ctx, `SELECT finished_at IS NOT NULL FROM subscriber_backfills WHERE subscriber = $1`, late.name).Scan(&finished)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, late.name + "'s backfill not started"
	case err != nil:
		return false, late.name + "'s backfill: " + err.Error()
	case !finished:
		return false, late.name + "'s backfill running"
	}
	return true, ""
}

// checkBackfill: each late subscriber joined and its backfill finished;
// the rows it could not apply are exactly planted bad input (for
// invoicing, orders whose line names a missing product; for the others,
// none), each with the handler's reason.
func (r *run) checkBackfill(ctx context.Context) {
	for _, late := range r.late {
		r.checkLate(ctx, late)
	}
}

func (r *run) checkLate(ctx context.Context, late *lateSubscriber) {
	rep := r.report
	if late.joinedAt.IsZero() {
		rep.violate("12 (a late subscriber)", late.name+" never joined: the check proves nothing")
		return
	}
	var done, failed int64
	var finished bool
	if err := r.pool().QueryRow(ctx, `SELECT done_rows, failed_rows, finished_at IS NOT NULL FROM subscriber_backfills WHERE subscriber = $1`,
		late.name).Scan(&done, &failed, &finished); err != nil {
		rep.violate("12 (read the backfill of "+late.name+")", err.Error())
		return
	}
	if rep.Backfilled == nil {
		rep.Backfilled = map[string]int64{}
	}
	rep.Backfilled[late.name] = done
	if !finished || done == 0 {
		rep.violate("12 (the backfill finishes)", fmt.Sprintf("%s: %d rows done, finished %t", late.name, done, finished))
	}
	rows, err := r.pool().Query(ctx, `
SELECT f.row_key, f.reason, EXISTS (SELECT FROM order_lines l WHERE l.order_id = f.row_key AND l.product_id = $2 AND l.sku IS NULL)
FROM subscriber_backfill_failures f WHERE f.subscriber = $1 ORDER BY f.row_key`, late.name, missingProduct)
	if err != nil {
		rep.violate("12 (read the backfill's failures)", err.Error())
		return
	}
	var wrong []string
	var key int64
	var reason string
	var planted bool
	if _, err := pgx.ForEachRow(rows, []any{&key, &reason, &planted}, func() error {
		if late.name != invoicing.Name || !planted || !strings.Contains(reason, invoicing.ErrMissingProduct.Error()) {
			wrong = append(wrong, fmt.Sprintf("%s: row %d: %s", late.name, key, reason))
		}
		return nil
	}); err != nil {
		rep.violate("12 (read the backfill's failures)", err.Error())
		return
	}
	if len(wrong) > 0 {
		rep.violate("12 (only planted rows fail the backfill)", head(wrong))
	}
}
