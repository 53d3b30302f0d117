package bookkeeping_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/subscribers/bookkeeping"
	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The checkpoint: a claim returns only the events not there before, a
// subscriber sees only its own rows, and a prune goes in batches of
// CheckpointPruneBatch.
func TestCheckpoints(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	s := bookkeeping.New(db.Pool)
	errRollBack := errors.New("roll back")
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		if err := bookkeeping.New(tx).AccessCheck(ctx, bookkeeping.AccessCheckParams{Subscriber: "a"}); err != nil {
			return err
		}
		return errRollBack
	})
	if !errors.Is(err, errRollBack) {
		t.Fatalf("access check as the table owner: %v", err)
	}
	claim := func(ids ...int64) []int64 {
		t.Helper()
		var fresh []int64
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) (err error) {
			fresh, err = bookkeeping.New(tx).CheckpointClaim(ctx, bookkeeping.CheckpointParams{Subscriber: "a", EventIDs: ids})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(fresh)
		return fresh
	}
	if got := claim(1, 2); !slices.Equal(got, []int64{1, 2}) {
		t.Fatalf("first claim of 1, 2 returned %v", got)
	}
	if got := claim(2, 3); !slices.Equal(got, []int64{3}) {
		t.Fatalf("claim of 2, 3 after 1, 2 returned %v, want [3]", got)
	}
	if err := s.CheckpointRecord(ctx, bookkeeping.CheckpointRecordParams{Subscriber: "b", Handled: []int64{3, 4}}); err != nil {
		t.Fatal(err)
	}
	if got, err := s.CheckpointList(ctx, bookkeeping.CheckpointParams{Subscriber: "a", EventIDs: []int64{3, 4, 5}}); err != nil || !slices.Equal(got, []int64{3}) {
		t.Errorf("a's checkpoint among 3, 4, 5: %v (%v), want [3]", got, err)
	}
	if ok, err := s.CheckpointExists(ctx, bookkeeping.CheckpointKeyParams{Subscriber: "b", EventID: 4}); err != nil || !ok {
		t.Errorf("b's event 4 checkpointed: %t (%v)", ok, err)
	}
	if err := s.CheckpointDelete(ctx, bookkeeping.CheckpointKeyParams{Subscriber: "b", EventID: 4}); err != nil {
		t.Fatal(err)
	}
	if ok, _ := s.CheckpointExists(ctx, bookkeeping.CheckpointKeyParams{Subscriber: "b", EventID: 4}); ok {
		t.Error("b's event 4 still checkpointed after its delete")
	}
	// The access check's row -1 is not an event.
	if any, err := s.CheckpointAny(ctx, "c"); err != nil || any {
		t.Errorf("c has checkpoints: %t (%v)", any, err)
	}
	if counts, err := s.CheckpointCount(ctx); err != nil || counts["a"] != 3 || counts["b"] != 1 {
		t.Errorf("counts %v (%v), want a 3 and b 1", counts, err)
	}

	if _, err := db.Pool.Exec(ctx, `INSERT INTO processed_events (subscriber, event_id, processed_at)
SELECT 'old', g, now() - interval '2 hours' FROM generate_series(1, $1) g`, bookkeeping.CheckpointPruneBatch+1); err != nil {
		t.Fatal(err)
	}
	prune := bookkeeping.PruneParams{Subscriber: "old", OlderThan: time.Hour}
	for i, want := range []int64{bookkeeping.CheckpointPruneBatch, 1, 0} {
		if n, err := s.CheckpointPrune(ctx, prune); err != nil || n != want {
			t.Fatalf("prune %d deleted %d (%v), want %d", i+1, n, err, want)
		}
	}
}

// The attempts: opened and closed per delivery, failures counted (closing
// the attempt they end), read with the checkpoint, deleted when done with.
func TestAttempts(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	s := bookkeeping.New(db.Pool)
	ids := bookkeeping.CheckpointParams{Subscriber: "a", EventIDs: []int64{1, 2}}
	for range 2 {
		if err := s.AttemptOpen(ctx, ids); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.AttemptClose(ctx, bookkeeping.CheckpointParams{Subscriber: "a", EventIDs: []int64{1}}); err != nil {
		t.Fatal(err)
	}
	for want := 1; want <= 2; want++ {
		n, err := s.AttemptFail(ctx, bookkeeping.AttemptFailParams{Subscriber: "a", EventID: 2, Error: "boom", Closing: true})
		if err != nil || n != want {
			t.Fatalf("failure %d counted as %d (%v)", want, n, err)
		}
	}
	if err := s.CheckpointRecord(ctx, bookkeeping.CheckpointRecordParams{Subscriber: "a", Handled: []int64{3}}); err != nil {
		t.Fatal(err)
	}
	states, err := s.AttemptList(ctx, bookkeeping.CheckpointParams{Subscriber: "a", EventIDs: []int64{1, 2, 3, 4}})
	if err != nil {
		t.Fatal(err)
	}
	want := map[int64]bookkeeping.AttemptState{
		1: {HasRow: true, OpenAttempts: 1},
		2: {HasRow: true, Failures: 2, LastError: "boom"},
		3: {Done: true},
		4: {},
	}
	for id, w := range want {
		if states[id] != w {
			t.Errorf("event %d: %+v, want %+v", id, states[id], w)
		}
	}
	if err := s.CheckpointRecord(ctx, bookkeeping.CheckpointRecordParams{Subscriber: "a", Forget: []int64{1}}); err != nil {
		t.Fatal(err)
	}
	if err := s.AttemptDelete(ctx, bookkeeping.CheckpointParams{Subscriber: "a", EventIDs: []int64{2}}); err != nil {
		t.Fatal(err)
	}
	states, err = s.AttemptList(ctx, ids)
	if err != nil || states[1].HasRow || states[2].HasRow {
		t.Errorf("after forgetting 1 and 2: %+v (%v)", states, err)
	}
	if err := s.AttemptPrune(ctx, bookkeeping.PruneParams{Subscriber: "a", OlderThan: time.Hour}); err != nil {
		t.Fatal(err)
	}
}

// The ordered checkpoint: advanced from n-1 to n only, held behind a dead
// letter (and released), or moved past it.
func TestAggregates(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	s := bookkeeping.New(db.Pool)
	k1, k2 := bookkeeping.AggregateKey{Type: "order", ID: "1"}, bookkeeping.AggregateKey{DB: "other", Type: "order", ID: "1"}
	advance := func(p bookkeeping.AggregateAdvanceParams) []int64 {
		t.Helper()
		p.Subscriber = "a"
		got, err := s.AggregateAdvance(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(got)
		return got
	}
	// Number 1 of k1 starts it; number 2 of k2 (no gap) cannot.
	got := advance(bookkeeping.AggregateAdvanceParams{Keys: []bookkeeping.AggregateKey{k1, k2}, Seqs: []int64{1, 2}, Prevs: []int64{0, 1},
		Events: []int64{101, 202}, AfterGap: []bool{false, false}})
	if !slices.Equal(got, []int64{101}) {
		t.Fatalf("advanced %v, want [101]", got)
	}
	// After a gap, number 3 of k2 starts it.
	if got := advance(bookkeeping.AggregateAdvanceParams{Keys: []bookkeeping.AggregateKey{k2}, Seqs: []int64{3}, Prevs: []int64{0},
		Events: []int64{203}, AfterGap: []bool{true}}); !slices.Equal(got, []int64{203}) {
		t.Fatalf("advanced %v after a gap, want [203]", got)
	}
	// Number 2 of k1 is held behind its dead letter; number 3 cannot pass.
	dead := bookkeeping.AggregateDeadLetterParams{Subscriber: "a", Key: k1, Seq: 2, Event: 102}
	if err := s.AggregateHold(ctx, dead); err != nil {
		t.Fatal(err)
	}
	if got := advance(bookkeeping.AggregateAdvanceParams{Keys: []bookkeeping.AggregateKey{k1}, Seqs: []int64{3}, Prevs: []int64{2},
		Events: []int64{103}, AfterGap: []bool{false}}); len(got) != 0 {
		t.Fatalf("advanced %v past a hold", got)
	}
	states, err := s.AggregateList(ctx, bookkeeping.AggregateListParams{Subscriber: "a", Keys: []bookkeeping.AggregateKey{k1, k2, {Type: "order", ID: "9"}}})
	if err != nil {
		t.Fatal(err)
	}
	if st := states[k1]; !st.Exists || st.Last != 1 || st.HeldBy != 102 || st.HeldSeq != 2 {
		t.Errorf("k1 %+v, want at 1, held by 102 (number 2)", st)
	}
	if st := states[k2]; st.Last != 3 || st.HeldBy != 0 {
		t.Errorf("k2 %+v, want at 3", st)
	}
	if st := states[bookkeeping.AggregateKey{Type: "order", ID: "9"}]; st.Exists {
		t.Errorf("an aggregate never seen exists: %+v", st)
	}
	if counts, err := s.AggregateCountHeld(ctx); err != nil || counts["a"] != 1 {
		t.Errorf("held %v (%v), want a 1", counts, err)
	}
	if ok, err := s.AggregateRelease(ctx, bookkeeping.CheckpointKeyParams{Subscriber: "a", EventID: 102}); err != nil || !ok {
		t.Fatalf("release: %t (%v)", ok, err)
	}
	if got := advance(bookkeeping.AggregateAdvanceParams{Keys: []bookkeeping.AggregateKey{k1}, Seqs: []int64{3}, Prevs: []int64{2},
		Events: []int64{103}, AfterGap: []bool{false}}); !slices.Equal(got, []int64{103}) {
		t.Fatalf("advanced %v after the release, want [103]", got)
	}
	// Under skip, a dead letter moves its aggregate past it.
	if err := s.AggregatePass(ctx, bookkeeping.AggregateDeadLetterParams{Subscriber: "a", Key: k1, Seq: 4, Event: 104}); err != nil {
		t.Fatal(err)
	}
	if states, err := s.AggregateList(ctx, bookkeeping.AggregateListParams{Subscriber: "a", Keys: []bookkeeping.AggregateKey{k1}}); err != nil || states[k1].Last != 4 {
		t.Errorf("k1 %+v (%v) after a pass of number 4", states[k1], err)
	}
}

// Origins are numbered once; dead letters are vouched for under the
// subscriber's name.
func TestOriginsAndDeadLetters(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	s := bookkeeping.New(db.Pool)
	origin := "7000000000000000001/other/1"
	if _, err := db.Pool.Exec(ctx, `SELECT fanout_origin_allow('7000000000000000001', 'other', 'a test')`); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := s.OriginGet(ctx, origin); err != nil || ok {
		t.Fatalf("an origin never seen has a number: %t (%v)", ok, err)
	}
	n, ok, err := s.OriginNumber(ctx, origin)
	if err != nil || !ok {
		t.Fatalf("number an origin: %t (%v)", ok, err)
	}
	if again, _, err := s.OriginNumber(ctx, origin); err != nil || again != n {
		t.Errorf("numbered again as %d (%v), first %d", again, err, n)
	}
	if got, ok, err := s.OriginGet(ctx, origin); err != nil || !ok || got != n {
		t.Errorf("origin's number %d, %t (%v), want %d", got, ok, err, n)
	}
	p := bookkeeping.DeadLetterVouchParams{Subscriber: "a", StreamSeq: 7, EventID: 42, Digest: []byte{1, 2}}
	for range 2 { // a crash makes the runtime vouch again
		if err := s.DeadLetterVouch(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	var rows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM dead_letters WHERE subscriber = 'a' AND stream_seq = 7 AND event_id = 42`).Scan(&rows); err != nil || rows != 1 {
		t.Errorf("%d vouched rows (%v), want 1", rows, err)
	}
}

// A backfill's progress: started with its segments, fenced chunk by chunk,
// paused, its failures recorded, finished once every segment is.
func TestBackfills(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	s := bookkeeping.New(db.Pool)
	if _, ok, err := s.BackfillGet(ctx, "a"); err != nil || ok {
		t.Fatalf("a backfill before any: %t (%v)", ok, err)
	}
	start := bookkeeping.BackfillStartParams{Subscriber: "a", Where: "t.id > 0", HighKey: 20, Total: 20, Segments: [][2]int64{{0, 10}, {10, 20}}}
	if err := s.BackfillStart(ctx, start); err != nil {
		t.Fatal(err)
	}
	b, ok, err := s.BackfillGet(ctx, "a")
	if err != nil || !ok || b.Where != "t.id > 0" || b.Total != 20 || b.Segments != 2 || b.SegmentsDone != 0 || b.Finished() {
		t.Fatalf("started backfill %+v, %t (%v)", b, ok, err)
	}
	segments, err := s.BackfillSegmentList(ctx, "a")
	if err != nil || !slices.Equal(segments, []bookkeeping.BackfillSegment{{N: 0, To: 10, Last: 0}, {N: 1, To: 20, Last: 10}}) {
		t.Fatalf("segments %+v (%v)", segments, err)
	}
	errPaused := errors.New("paused")
	chunk := func(segment int, last, done, failed int64) bool {
		t.Helper()
		var moved bool
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			ts := bookkeeping.New(tx)
			l, err := ts.BackfillSegmentLock(ctx, bookkeeping.BackfillSegmentParams{Subscriber: "a", Segment: segment})
			if err != nil {
				return err
			}
			if !l.StartedAt.Equal(b.StartedAt) {
				t.Errorf("locked segment %d of a backfill started %s, want %s", segment, l.StartedAt, b.StartedAt)
			}
			if failed > 0 {
				if err := ts.BackfillFailureRecord(ctx, bookkeeping.BackfillFailureRecordParams{Subscriber: "a", Key: last, Reason: "bad row"}); err != nil {
					return err
				}
			}
			moved, err = ts.BackfillSegmentAdvance(ctx, bookkeeping.BackfillSegmentAdvanceParams{Subscriber: "a", Segment: segment, LastKey: last, Done: done, Failed: failed})
			if err == nil && !moved {
				return errPaused // as the backfill does: the chunk is undone
			}
			return err
		})
		if err != nil && !errors.Is(err, errPaused) {
			t.Fatal(err)
		}
		return moved
	}
	if !chunk(0, 10, 9, 1) {
		t.Fatal("chunk of segment 0 not counted")
	}
	if ok, err := s.BackfillPause(ctx, bookkeeping.BackfillPauseParams{Subscriber: "a", Paused: true}); err != nil || !ok {
		t.Fatalf("pause: %t (%v)", ok, err)
	}
	if chunk(1, 20, 10, 0) {
		t.Fatal("a chunk counted while paused")
	}
	if _, err := s.BackfillPause(ctx, bookkeeping.BackfillPauseParams{Subscriber: "a", Paused: false}); err != nil {
		t.Fatal(err)
	}
	if err := s.BackfillFinish(ctx, bookkeeping.BackfillFinishParams{Subscriber: "a", StartedAt: b.StartedAt}); err != nil {
		t.Fatal(err)
	}
	if b, _, _ := s.BackfillGet(ctx, "a"); b.Finished() {
		t.Fatal("finished with segment 1 left")
	}
	if !chunk(1, 20, 10, 0) {
		t.Fatal("chunk of segment 1 not counted after the resume")
	}
	if err := s.BackfillFinish(ctx, bookkeeping.BackfillFinishParams{Subscriber: "a", StartedAt: b.StartedAt}); err != nil {
		t.Fatal(err)
	}
	list, err := s.BackfillList(ctx)
	if err != nil || len(list) != 1 || !list[0].Finished() || list[0].Done != 19 || list[0].Failed != 1 || list[0].SegmentsDone != 2 {
		t.Fatalf("backfills %+v (%v), want a's finished with 19 done, 1 failed", list, err)
	}
	failures, err := s.BackfillFailureList(ctx, "a")
	if err != nil || len(failures) != 1 || failures[0].Key != 10 || failures[0].Reason != "bad row" {
		t.Errorf("failures %+v (%v)", failures, err)
	}
	if ok, err := s.BackfillPause(ctx, bookkeeping.BackfillPauseParams{Subscriber: "a", Paused: true}); err != nil || ok {
		t.Errorf("paused a finished backfill: %t (%v)", ok, err)
	}
	// Started again, it forgets the last one's segments and failures.
	if err := s.BackfillStart(ctx, bookkeeping.BackfillStartParams{Subscriber: "a", HighKey: 5, Total: 5, Segments: [][2]int64{{0, 5}}}); err != nil {
		t.Fatal(err)
	}
	if failures, err := s.BackfillFailureList(ctx, "a"); err != nil || len(failures) != 0 {
		t.Errorf("failures after a restart %+v (%v)", failures, err)
	}
	if b, _, err := s.BackfillGet(ctx, "a"); err != nil || b.Finished() || b.Done != 0 || b.Segments != 1 {
		t.Errorf("restarted backfill %+v (%v)", b, err)
	}
}
