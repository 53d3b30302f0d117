package relay

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// visibilityGate holds a decoded transaction back until readers can see it.
//
// The walsender decodes a commit as soon as its record is in the WAL, a
// moment before the committing backend leaves the proc array, and until
// then other sessions do not see the transaction. A subscriber that got its
// event first and read the rows it names would not find them (measured: the
// fault run's sales ledger dead-lettered an order "that does not exist").
// The poll relay never has this race: it claims only rows it can see. So a
// transaction is published only once a snapshot taken after its commit
// shows it; one snapshot, taken for whoever waits, answers for every
// transaction waiting at that moment.
type visibilityGate struct {
	pool *pgxpool.Pool

	mu       sync.Mutex
	snap     snapshot
	fetching chan struct{} // closed when the fetch in progress ends
	err      error         // of the last fetch
}

// snapshot is a pg_current_snapshot(): xids below xmin are finished, xids
// from xmax on had not started, xip were in progress.
type snapshot struct {
	xmin, xmax uint64
	xip        map[uint64]bool
}

// visible reports whether the transaction with 32-bit id xid (committed,
// as decoded) is visible in s.
func (s snapshot) visible(xid uint32) bool {
	if s.xmax == 0 {
		return false
	}
	// The full id is the one below xmax whose low 32 bits are xid: in
	// xmax's epoch, or the one before.
	full := s.xmax&^0xFFFFFFFF | uint64(xid)
	if full >= s.xmax {
		if full < 1<<32 {
			return false
		}
		full -= 1 << 32
	}
	return !s.xip[full]
}

func parseSnapshot(text string) (snapshot, error) {
	parts := strings.Split(text, ":")
	if len(parts) != 3 {
		return snapshot{}, fmt.Errorf("snapshot %q: want xmin:xmax:xip", text)
	}
	var s snapshot
	var err error
	if s.xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return snapshot{}, fmt.Errorf("snapshot %q: %w", text, err)
	}
	if s.xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return snapshot{}, fmt.Errorf("snapshot %q: %w", text, err)
	}
	s.xip = map[uint64]bool{}
	if parts[2] != "" {
		for _, x := range strings.Split(parts[2], ",") {
			id, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return snapshot{}, fmt.Errorf("snapshot %q: %w", text, err)
			}
			s.xip[id] = true
		}
	}
	return s, nil
}

// wait returns once xid is visible to new snapshots, or ctx ends. Postgres
// unreachable is waited out like any outage.
func (g *visibilityGate) wait(ctx context.Context, xid uint32) error {
	g.mu.Lock()
	if g.snap.visible(xid) {
		g.mu.Unlock()
		return nil
	}
	g.mu.Unlock()
	pause := time.Millisecond
	for {
		snap, err := g.fresh(ctx)
		if err == nil && snap.visible(xid) {
			return nil
		}
		if err != nil {
			pause = min(max(pause*2, 50*time.Millisecond), 2*time.Second)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(pause):
		}
	}
}

// fresh returns a snapshot taken after the call began: it joins a fetch
// that starts after the call, or starts one.
func (g *visibilityGate) fresh(ctx context.Context) (snapshot, error) {
	g.mu.Lock()
	if running := g.fetching; running != nil {
		// A fetch in progress may have begun before our commit was
		// visible: wait for it, then for one of our own.
		g.mu.Unlock()
		if err := waitClosed(ctx, running); err != nil {
			return snapshot{}, err
		}
		g.mu.Lock()
	}
	if g.fetching == nil {
		done := make(chan struct{})
		g.fetching = done
		g.mu.Unlock()
		fetchCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		var text string
		err := g.pool.QueryRow(fetchCtx, `SELECT pg_current_snapshot()::text`).Scan(&text)
		cancel()
		var snap snapshot
		if err == nil {
			snap, err = parseSnapshot(text)
		}
		g.mu.Lock()
		if err == nil {
			g.snap = snap
		}
		g.err = err
		g.fetching = nil
		close(done)
		g.mu.Unlock()
		return snap, err
	}
	// Another caller started a fetch after ours was due: it began after
	// our call, so its snapshot will do.
	running := g.fetching
	g.mu.Unlock()
	if err := waitClosed(ctx, running); err != nil {
		return snapshot{}, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.snap, g.err
}

// waitClosed waits for ch to close, or ctx to end.
func waitClosed(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
