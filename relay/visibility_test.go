package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fanout/fanout/schema/pgtest"
)

func TestSnapshotVisible(t *testing.T) {
	s, err := parseSnapshot("4294967390:4294967400:4294967395")
	if err != nil {
		t.Fatal(err)
	}
	// xmin is 2^32+94, xmax 2^32+104, and 2^32+99 is in progress.
	for _, tc := range []struct {
		xid  uint32
		want bool
	}{
		{94, true},         // xmin, finished
		{98, true},         // finished, between xmin and xmax
		{103, true},        // the last id assigned
		{99, false},        // in progress
		{4294967290, true}, // the epoch before, long finished
		{4294967295, true}, // the last id of the epoch before
	} {
		if got := s.visible(tc.xid); got != tc.want {
			t.Errorf("xid %d in %v: visible %t, want %t", tc.xid, s, got, tc.want)
		}
	}
	if (snapshot{}).visible(1) {
		t.Error("the zero snapshot shows a transaction")
	}
	for _, bad := range []string{"", "1:2", "a:2:", "1:2:x"} {
		if _, err := parseSnapshot(bad); err == nil {
			t.Errorf("parseSnapshot(%q) took it", bad)
		}
	}
}

// The gate holds a transaction back while other sessions cannot see it,
// and lets it through once they can.
func TestVisibilityGateWaitsForTheCommit(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	var xid uint32
	if err := tx.QueryRow(ctx, `SELECT (pg_current_xact_id()::text::bigint % 4294967296)::bigint`).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	g := &visibilityGate{pool: db.Pool}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if err := g.wait(short, xid); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait for a transaction still open returned %v, want it to wait", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	done, cancel2 := context.WithTimeout(ctx, 10*time.Second)
	defer cancel2()
	if err := g.wait(done, xid); err != nil {
		t.Fatalf("wait after the commit: %v", err)
	}
}
