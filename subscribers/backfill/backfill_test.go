package backfill_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/backfill"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/fanout/fanout/subscribers/subscribertest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if url := os.Getenv(backfillChildEnv); url != "" {
		os.Exit(backfillChild(url)) // the process a backfill test kills
	}
	goleak.VerifyTestMain(m)
}

// tally is a backfilled subscriber whose effect is not idempotent: each
// event adds 1 to its row's count in backfill_tally, so a row applied twice
// shows as 2. Rows of backfill_source marked bad are refused (Permanent);
// rows marked flaky fail every time with a plain error.
type tally struct {
	calls atomic.Int64
}

func (h *tally) HandleTx(ctx context.Context, tx pgx.Tx, ev subscribers.Event) error {
	h.calls.Add(1)
	var p struct {
		ID   int64  `json:"id"`
		Kind string `json:"kind"`
	}
	if err := json.Unmarshal(ev.Payload, &p); err != nil {
		return subscribers.Permanent(err)
	}
	switch p.Kind {
	case "bad":
		return subscribers.Permanent(fmt.Errorf("row %d is bad", p.ID))
	case "flaky":
		return errors.New("flaky row fails again")
	}
	_, err := tx.Exec(ctx, `INSERT INTO backfill_tally (id, n) VALUES ($1, 1) ON CONFLICT (id) DO UPDATE SET n = backfill_tally.n + 1`, p.ID)
	return err
}

// tallyBatch is tally as a BatchTxHandler.
type tallyBatch struct{ *tally }

// slowBatch holds each chunk's transaction open a while after handling it,
// so that a chunk is in flight whenever something else happens.
type slowBatch struct {
	tallyBatch
	hold time.Duration
}

func (h slowBatch) HandleBatchTx(ctx context.Context, tx pgx.Tx, evs []subscribers.Event) error {
	if err := h.tallyBatch.HandleBatchTx(ctx, tx, evs); err != nil {
		return err
	}
	time.Sleep(h.hold)
	return nil
}

func (h tallyBatch) HandleBatchTx(ctx context.Context, tx pgx.Tx, evs []subscribers.Event) error {
	ids := make([]int64, 0, len(evs))
	for _, ev := range evs {
		var p struct {
			ID   int64  `json:"id"`
			Kind string `json:"kind"`
		}
		if err := json.Unmarshal(ev.Payload, &p); err != nil || p.Kind != "" {
			return errors.New("the batch holds a row to handle alone")
		}
		ids = append(ids, p.ID)
	}
	_, err := tx.Exec(ctx, `INSERT INTO backfill_tally (id, n) SELECT id, 1 FROM unnest($1::bigint[]) AS id
ON CONFLICT (id) DO UPDATE SET n = backfill_tally.n + 1`, ids)
	return err
}

var tallyDecl = subscribers.Declaration{
	Name: "tally", EventTypes: []string{"thing.created"},
	Backfill: &subscribers.Backfill{Table: "backfill_source", Key: "id", EventType: "thing.created", AggregateType: "thing",
		Payload: "jsonb_build_object('id', t.id, 'kind', t.kind)"},
	New: func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Tx(&tally{}), nil },
}

// tallyDB is a database with n rows in backfill_source.
func tallyDB(t testing.TB, n int, kinds map[int64]string) *pgtest.DB {
	t.Helper()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, `
CREATE TABLE backfill_source (id bigint PRIMARY KEY, kind text NOT NULL DEFAULT '');
CREATE TABLE backfill_tally (id bigint PRIMARY KEY, n int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	// Keys with gaps and from below zero: chunks are key ranges, not counts.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO backfill_source (id) SELECT g * 3 - 30 FROM generate_series(1, $1) g`, n); err != nil {
		t.Fatal(err)
	}
	for id, kind := range kinds {
		if _, err := db.Pool.Exec(ctx, `UPDATE backfill_source SET kind = $2 WHERE id = $1`, id, kind); err != nil {
			t.Fatal(err)
		}
	}
	return db
}

func backfillOptions(t testing.TB, pool *pgxpool.Pool, h subscribers.TxHandler) backfill.Options {
	cfg := subscribers.DefaultConfig()
	cfg.RetryMin, cfg.RetryMax, cfg.MaxFailures = 50*time.Millisecond, 200*time.Millisecond, 3
	return backfill.Options{Declaration: tallyDecl, Handler: subscribers.Tx(h), Config: cfg, Pool: pool,
		Logger: subscribertest.Logger(t.(*testing.T)), Chunk: 100, Workers: 2}
}

// checkTally fails unless every row of backfill_source but the ones in
// except was applied exactly once, and no other.
func checkTally(t *testing.T, pool *pgxpool.Pool, except ...int64) {
	t.Helper()
	if err := tallyErrors(pool, except...); err != nil {
		t.Fatal(err)
	}
}

func tallyErrors(pool *pgxpool.Pool, except ...int64) error {
	var missing, twice, stray []int64
	rows, err := pool.Query(context.Background(), `
SELECT coalesce(s.id, y.id), s.id IS NULL, coalesce(y.n, 0)
FROM backfill_source s FULL JOIN backfill_tally y ON y.id = s.id
WHERE s.id IS NULL OR NOT (s.id = ANY(coalesce($1::bigint[], '{}')))
ORDER BY 1`, except)
	if err != nil {
		return err
	}
	var id int64
	var isStray bool
	var n int
	if _, err := pgx.ForEachRow(rows, []any{&id, &isStray, &n}, func() error {
		switch {
		case isStray:
			stray = append(stray, id)
		case n == 0:
			missing = append(missing, id)
		case n > 1:
			twice = append(twice, id)
		}
		return nil
	}); err != nil {
		return err
	}
	if len(missing)+len(twice)+len(stray) > 0 {
		return fmt.Errorf("backfill_tally against backfill_source: %d rows never applied %v, %d applied more than once %v, %d applied and not to apply %v",
			len(missing), head(missing), len(twice), head(twice), len(stray), head(stray))
	}
	return nil
}

func head(ids []int64) []int64 { return ids[:min(len(ids), 10)] }

// A backfill whose process is killed (SIGKILL, mid-chunk, again and again)
// resumes after its last committed chunk: every row applied once, none
// twice, with a handler whose effect is not idempotent.
func TestBackfillResumesAfterKill9WithNoRowSkippedOrTwice(t *testing.T) {
	t.Parallel()
	if err := killBackfill(t, false); err != nil {
		t.Fatal(err)
	}
}

// The kill test's checker, shown failing: with the chunk's effects and its
// checkpoint committed apart (a test hook), a kill between them applies
// rows twice, and the check reports it.
func TestBackfillKillCheckSeesACheckpointApartFromItsChunk(t *testing.T) {
	t.Parallel()
	err := killBackfill(t, true)
	if err == nil || !strings.Contains(err.Error(), "applied more than once") {
		t.Fatalf("with the checkpoint apart from its chunk the check found %v, want rows applied more than once", err)
	}
}

// killBackfill runs tally's backfill of 20,000 rows in a process it kills
// at random points, at least twice, then to the end here, and returns what
// the tally check finds.
func killBackfill(t *testing.T, apart bool) error {
	db := tallyDB(t, 20000, nil)
	kills := 0
	for kills < 4 {
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), backfillChildEnv+"="+db.URL)
		if apart {
			cmd.Env = append(cmd.Env, backfillApartEnv+"=1")
		}
		out := &strings.Builder{}
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Kill it somewhere in its run, once it has done some chunks.
		before := backfillDone(t, db.Pool)
		deadline := time.Now().Add(30 * time.Second)
		for backfillDone(t, db.Pool) < before+1000+int64(rand.IntN(2000)) && time.Now().Before(deadline) {
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
		}
		_ = cmd.Process.Signal(syscall.SIGKILL)
		err := cmd.Wait()
		s, _, _ := bookkeeping.New(db.Pool).BackfillGet(context.Background(), "tally")
		if s.Finished() {
			break
		}
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("the backfill process ended with %v before it was killed:\n%s", err, out)
		}
		kills++
		t.Logf("killed at %d rows done", s.Done)
	}
	if kills < 2 {
		t.Fatalf("the backfill finished after %d kills: too fast to test", kills)
	}
	s, err := backfill.Run(context.Background(), backfillOptions(t, db.Pool, &tally{}))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Finished() || s.Done != 20000 || s.Failed != 0 {
		t.Fatalf("after %d kills: backfill %+v, want finished with 20000 rows done", kills, s)
	}
	return tallyErrors(db.Pool)
}

// backfillChildEnv, set to a database's URL, makes the test binary the
// process TestBackfillResumesAfterKill9... kills: it runs tally's backfill
// there (TestMain).
const backfillChildEnv = "FANOUT_TEST_BACKFILL_CHILD"

// backfillApartEnv makes the child commit each chunk's checkpoint apart
// from its effects (Hooks.CheckpointApart).
const backfillApartEnv = "FANOUT_TEST_BACKFILL_APART"

func backfillChild(url string) int {
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer pool.Close()
	cfg := subscribers.DefaultConfig()
	opts := backfill.Options{
		Declaration: tallyDecl, Handler: subscribers.Tx(tallyBatch{&tally{}}), Config: cfg, Pool: pool,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)), Chunk: 100, Workers: 2,
		Rate: 20000, // slow enough to be killed mid-run, many times
	}
	if os.Getenv(backfillApartEnv) != "" {
		// Most of each chunk's time between its two commits, so that
		// every kill lands in a window (at 20 ms, the four kills of a CI
		// run once all missed them: a kill follows a checkpoint's commit,
		// and the other worker could be between chunks).
		opts.Hooks.CheckpointApart = 200 * time.Millisecond
	}
	_, err = backfill.Run(context.Background(), opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func backfillDone(t *testing.T, pool *pgxpool.Pool) int64 {
	s, _, err := bookkeeping.New(pool).BackfillGet(context.Background(), "tally")
	if err != nil {
		t.Fatal(err)
	}
	return s.Done
}

// A row the handler refuses (Permanent) and one it fails on every time
// become failure rows with their reasons; every other row is applied, the
// ones around them included, once.
func TestBackfillRecordsRowsItCannotApplyAndGoesOn(t *testing.T) {
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%t", batch), func(t *testing.T) {
			t.Parallel()
			db := tallyDB(t, 1000, map[int64]string{-27: "bad", 300: "flaky", 1500: "bad"})
			h := &tally{}
			var th subscribers.TxHandler = h
			if batch {
				th = tallyBatch{h}
			}
			s, err := backfill.Run(context.Background(), backfillOptions(t, db.Pool, th))
			if err != nil {
				t.Fatal(err)
			}
			if !s.Finished() || s.Done != 997 || s.Failed != 3 {
				t.Fatalf("backfill %+v, want finished with 997 rows done and 3 failed", s)
			}
			checkTally(t, db.Pool, -27, 300, 1500)
			fs, err := bookkeeping.New(db.Pool).BackfillFailureList(context.Background(), "tally")
			if err != nil {
				t.Fatal(err)
			}
			want := map[int64]string{-27: "row -27 is bad", 300: "gave up after 3 failures (subscribers.max_failures): flaky row fails again", 1500: "row 1500 is bad"}
			if len(fs) != len(want) {
				t.Fatalf("failures %+v, want %v", fs, want)
			}
			for _, f := range fs {
				if want[f.Key] != f.Reason {
					t.Errorf("row %d failed with %q, want %q", f.Key, f.Reason, want[f.Key])
				}
			}
		})
	}
}

// Postgres cut off from the backfill, several times, for longer than its
// retries: it waits, fails no row (max_failures is 3), and ends with every
// row applied once.
func TestBackfillWaitsThroughPostgresOutages(t *testing.T) {
	t.Parallel()
	db := tallyDB(t, 5000, nil)
	pool, proxy := subscribertest.ProxiedPool(t, db.URL)
	opts := backfillOptions(t, pool, tallyBatch{&tally{}})
	opts.Rate = 1000
	var cuts atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for range 3 {
			select {
			case <-done:
				return
			case <-time.After(time.Second):
			}
			proxy.Cut()
			cuts.Add(1)
			time.Sleep(1500 * time.Millisecond)
			proxy.Restore()
		}
	})
	s, err := backfill.Run(context.Background(), opts)
	close(done)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if cuts.Load() < 2 {
		t.Fatalf("only %d outages during the backfill", cuts.Load())
	}
	if !s.Finished() || s.Done != 5000 || s.Failed != 0 {
		t.Fatalf("after %d outages: backfill %+v, want finished with 5000 rows done, none failed", cuts.Load(), s)
	}
	checkTally(t, db.Pool)
}

// A paused backfill applies nothing until it is resumed, then finishes.
func TestBackfillPausesAndResumes(t *testing.T) {
	t.Parallel()
	db := tallyDB(t, 3000, nil)
	opts := backfillOptions(t, db.Pool, slowBatch{tallyBatch{&tally{}}, 100 * time.Millisecond})
	sawPaused := make(chan struct{})
	var once sync.Once
	opts.Progress = func(s backfill.Status) {
		if s.Paused {
			once.Do(func() { close(sawPaused) })
		}
	}
	result := make(chan error, 1)
	go func() {
		_, err := backfill.Run(context.Background(), opts)
		result <- err
	}()
	subscribertest.WaitFor(t, 10*time.Second, "some rows done", func() (bool, string) {
		n := backfillDone(t, db.Pool)
		return n >= 500, fmt.Sprint(n, " done")
	})
	if err := backfill.Pause(context.Background(), db.Pool, "tally", true); err != nil {
		t.Fatal(err)
	}
	// Once the pause returns, nothing more is applied, not even a chunk
	// that one of the two workers had in flight.
	at := backfillDone(t, db.Pool)
	select {
	case <-sawPaused:
	case err := <-result:
		t.Fatalf("the backfill ended (%v) instead of pausing", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the backfill did not report its pause")
	}
	var applied int64
	time.Sleep(1500 * time.Millisecond)
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM backfill_tally`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if now := backfillDone(t, db.Pool); now != at || applied != at {
		t.Fatalf("paused at %d rows done; 1.5 s later %d done and %d applied", at, now, applied)
	}
	if at >= 3000 {
		t.Fatalf("paused only after the last row")
	}
	if err := backfill.Pause(context.Background(), db.Pool, "tally", false); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-result:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the resumed backfill did not finish")
	}
	checkTally(t, db.Pool)
}

// --where limits the rows; a bad one is an error that names it; a backfill
// resumed with another --where is refused, and --restart starts over.
func TestBackfillWhere(t *testing.T) {
	t.Parallel()
	db := tallyDB(t, 1000, nil)
	ctx := context.Background()
	opts := backfillOptions(t, db.Pool, &tally{})
	opts.Where = "t.id no_such_operator 3"
	_, err := backfill.Run(ctx, opts)
	if err == nil || !strings.Contains(err.Error(), "--where") || !strings.Contains(err.Error(), "no_such_operator") {
		t.Fatalf("a bad --where: %v, want an error naming --where and Postgres's complaint", err)
	}
	opts.Where = "t.id % 2 = 0"
	rctx, cancel := context.WithCancel(ctx)
	opts.Hooks.AfterRead = func([]int64) { cancel() }
	if _, err := backfill.Run(rctx, opts); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled backfill: %v", err)
	}
	opts.Hooks.AfterRead = nil
	opts.Where = "t.id > 0"
	if _, err := backfill.Run(ctx, opts); !errors.Is(err, backfill.ErrWhere) {
		t.Fatalf("resuming with another --where: %v, want ErrBackfillWhere", err)
	}
	opts.Where = ""
	s, err := backfill.Run(ctx, opts) // resumes the even ids
	if err != nil {
		t.Fatal(err)
	}
	if s.Where != "t.id % 2 = 0" || s.Total != 500 || s.Done != 500 {
		t.Fatalf("resumed backfill %+v, want the 500 even ids", s)
	}
	var odd, even int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE id % 2 <> 0), count(*) FILTER (WHERE id % 2 = 0 AND n = 1) FROM backfill_tally`).Scan(&odd, &even); err != nil {
		t.Fatal(err)
	}
	if odd != 0 || even != 500 {
		t.Fatalf("%d odd rows applied and %d even once, want 0 and 500", odd, even)
	}
	// --where cannot write: the read is read-only.
	opts.Restart, opts.Where = true, "(SELECT count(*) FROM (DELETE FROM backfill_tally RETURNING 1) d) >= 0"
	if _, err := backfill.Run(ctx, opts); err == nil {
		t.Fatal("a --where that deletes was run")
	}
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM backfill_tally`).Scan(&even); err != nil || even != 500 {
		t.Fatalf("backfill_tally after a --where that deletes: %d rows (%v), want 500", even, err)
	}
	// Nor through a function that writes as its owner (SECURITY DEFINER,
	// which a subscriber's role may call): the transaction is read-only
	// whoever runs the write.
	if _, err := db.Pool.Exec(ctx, `SELECT fanout_origin_allow('7000000000000000001', 'forged', 'a test')`); err != nil {
		t.Fatal(err) // registered: the function would number the origin, and so write
	}
	opts.Where = "fanout_origin_number('7000000000000000001/forged/1') IS NOT NULL"
	if _, err := backfill.Run(ctx, opts); err == nil || !strings.Contains(err.Error(), "read-only transaction") {
		t.Fatalf("a --where that writes through a SECURITY DEFINER function: %v, want a read-only refusal", err)
	}
	var forged int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM event_origins WHERE origin LIKE '%/forged/%'`).Scan(&forged); err != nil || forged != 0 {
		t.Fatalf("event_origins after a --where that writes through a function: %d forged rows (%v), want 0", forged, err)
	}
	opts.Where = ""
	if s, err := backfill.Run(ctx, opts); err != nil || s.Total != 1000 {
		t.Fatalf("restart: %+v, %v; want a new backfill of 1000 rows", s, err)
	}
}

// The segments cover the keys low..high exactly, each once, however wide
// the range.
func TestBackfillSegmentsCoverTheKeys(t *testing.T) {
	for _, c := range []struct {
		low, high int64
		n, want   int
	}{
		{1, 1000, 2, 2}, {1, 1000, 3, 3}, {-27, 59970, 2, 2}, {5, 5, 4, 1}, {0, 0, 2, 1}, {1, 2, 4, 1},
		{math.MinInt64, math.MaxInt64, 4, 4}, {math.MinInt64 + 1, -1, 2, 2},
	} {
		segs := backfill.SplitKeys(c.low, c.high, c.n)
		if len(segs) != c.want {
			t.Errorf("split(%d, %d, %d): %d segments %v, want %d", c.low, c.high, c.n, len(segs), segs, c.want)
			continue
		}
		if first := segs[0][0]; c.low > math.MinInt64 && first != c.low-1 {
			t.Errorf("split(%d, %d, %d) starts after %d, want after %d", c.low, c.high, c.n, first, c.low-1)
		}
		if last := segs[len(segs)-1][1]; last != c.high {
			t.Errorf("split(%d, %d, %d) ends at %d, want %d", c.low, c.high, c.n, last, c.high)
		}
		for i := range segs {
			if segs[i][0] > segs[i][1] {
				t.Errorf("split(%d, %d, %d): segment %v is backwards", c.low, c.high, c.n, segs[i])
			}
			if i > 0 && segs[i][0] != segs[i-1][1] {
				t.Errorf("split(%d, %d, %d): segment %v does not start where %v ends", c.low, c.high, c.n, segs[i], segs[i-1])
			}
		}
	}
}

// A finished backfill run again does nothing: a job done stays done.
func TestAFinishedBackfillIsNotRunAgain(t *testing.T) {
	t.Parallel()
	db := tallyDB(t, 300, nil)
	h := &tally{}
	first, err := backfill.Run(context.Background(), backfillOptions(t, db.Pool, h))
	if err != nil || !first.Finished() {
		t.Fatalf("first run: %+v, %v", first, err)
	}
	calls := h.calls.Load()
	again, err := backfill.Run(context.Background(), backfillOptions(t, db.Pool, h))
	if err != nil || !again.Finished() || !again.StartedAt.Equal(first.StartedAt) || h.calls.Load() != calls {
		t.Fatalf("second run: %+v, %v, %d handler calls after %d", again, err, h.calls.Load(), calls)
	}
	checkTally(t, db.Pool)
}
