package main

// Part bigtx: one writer transaction of -bigtx-rows events (a bulk import,
// a backfill in SQL), published by a running relay, against the drain of
// the same rows committed in transactions of 1000, in each capture mode,
// over 1 aggregate, over 5,000, and with an aggregate per event.

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime/metrics"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/outboxstore"
	"github.com/fanout/fanout/relay"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
)

var (
	bigTxRows    = flag.Int("bigtx-rows", 300_000, "events in the bigtx part's one transaction")
	bigTxShapes  = flag.String("bigtx-shapes", "1,5000,each", "the bigtx part's aggregates: a count, or each (an aggregate per event)")
	bigTxCapture = flag.String("bigtx-capture", "poll,wal", "the bigtx part's capture modes")
	bigTxProfile = flag.String("bigtx-cpuprofile", "", "write CPU profiles of the big transactions' publishing to PREFIX.<capture>.<aggregates>")
	bigTxAtomic  = flag.String("bigtx-atomic", "event,transaction", "the bigtx part's relay.atomic settings")
)

// aggregateShape is how a bigtx run spreads its events over aggregates.
type aggregateShape struct {
	name  string
	count int // 0: an aggregate per event
}

func bigTxShapeList() ([]aggregateShape, error) {
	var shapes []aggregateShape
	for _, s := range strings.Split(*bigTxShapes, ",") {
		if s == "each" {
			shapes = append(shapes, aggregateShape{name: "an aggregate per event"})
			continue
		}
		var n int
		if _, err := fmt.Sscanf(s, "%d", &n); err != nil || n < 1 {
			return nil, fmt.Errorf("-bigtx-shapes: %q is neither a count nor each", s)
		}
		shapes = append(shapes, aggregateShape{name: fmt.Sprintf("%d aggregates", n), count: n})
	}
	return shapes, nil
}

func benchBigTx(ctx context.Context, nc *nats.Conn) error {
	shapes, err := bigTxShapeList()
	if err != nil {
		return err
	}
	for _, capture := range strings.Split(*bigTxCapture, ",") {
		mode := capture
		if mode != relay.CapturePoll && mode != relay.CaptureWAL {
			return fmt.Errorf("-bigtx-capture: %q is neither poll nor wal", capture)
		}
		atomics := strings.Split(*bigTxAtomic, ",")
		for _, shape := range shapes {
			// The settings alternate within each round, so that their
			// ratio is measured side by side.
			type figures struct{ small, big, ratio, peak benchkit.Figure }
			got := make([]figures, len(atomics))
			var against, againstBig benchkit.Figure // the second setting's rates over the first's
			for range *benchkit.Runs {
				var first, firstBig float64
				for i, atomic := range atomics {
					s, _, err := bigTxRun(ctx, nc, mode, atomic, shape, 1000)
					if err != nil {
						return fmt.Errorf("bigtx %s, %s, relay.atomic %s, transactions of 1000: %w", capture, shape.name, atomic, err)
					}
					b, mem, err := bigTxRun(ctx, nc, mode, atomic, shape, *bigTxRows)
					if err != nil {
						return fmt.Errorf("bigtx %s, %s, relay.atomic %s, one transaction: %w", capture, shape.name, atomic, err)
					}
					got[i].small.Add(s)
					got[i].big.Add(b)
					got[i].ratio.Add(b / s)
					got[i].peak.Add(float64(mem) / (1 << 20))
					if i == 0 {
						first, firstBig = s, b
					} else {
						against.Add(s / first)
						againstBig.Add(b / firstBig)
					}
				}
			}
			for i, atomic := range atomics {
				f := &got[i]
				fmt.Printf("(bigtx) %s capture, relay.atomic %s, %d events over %s: one transaction %s, transactions of 1000 %s; ratio %s (target >= 0.8); peak Go memory of the process (relay and writer) in the one transaction %s (target <= 256)\n",
					capture, atomic, *bigTxRows, shape.name, f.big.Format("%.0f rows/s"), f.small.Format("%.0f rows/s"), f.ratio.Format("%.2f"), f.peak.Format("%.0f MB"))
			}
			if len(atomics) == 2 {
				fmt.Printf("(bigtx) %s capture, %s: relay.atomic %s against %s, transactions of 1000 %s, one transaction %s\n",
					capture, shape.name, atomics[1], atomics[0], against.Format("%.2f"), againstBig.Format("%.2f"))
			}
		}
	}
	return nil
}

// bigTxRun commits -bigtx-rows events in transactions of txRows while a
// relay in capture mode runs (caught up on an empty outbox first), and
// returns the rate from the first commit to the last PubAck. Transactions
// of 1000 are committed before the relay starts (a drain, as parts a and
// w): committing them alongside would time the writer.
func bigTxRun(ctx context.Context, nc *nats.Conn, mode, atomic string, shape aggregateShape, txRows int) (rate float64, peakMem uint64, err error) {
	env, err := newRelayEnv(ctx, nc, nil)
	if err != nil {
		return 0, 0, err
	}
	defer env.close()
	rc := relayConfig()
	rc.Capture, rc.Atomic = mode, atomic
	if mode == relay.CaptureWAL {
		rc.Slot = env.db.Name
	}
	drain := txRows < *bigTxRows
	if drain || mode == relay.CaptureWAL {
		// A wal relay's slot is made by its first start; the drain's
		// rows wait in it (or in the outbox) while the relay is stopped.
		if err := startAndStop(ctx, env, rc); err != nil {
			return 0, 0, err
		}
	}
	if drain {
		for from := 0; from < *bigTxRows; from += txRows {
			if err := fillShaped(ctx, env.db.Pool, shape, from, min(txRows, *bigTxRows-from)); err != nil {
				return 0, 0, err
			}
		}
		if err := benchkit.Settle(ctx, env.db.Pool); err != nil {
			return 0, 0, err
		}
	}
	obs := &counter{}
	opts := env.options(rc)
	opts.Observer = obs
	r, err := relay.New(opts)
	if err != nil {
		return 0, 0, err
	}
	start := time.Now()
	if err := r.Start(ctx); err != nil {
		return 0, 0, err
	}
	defer func() { _ = r.Stop(ctx) }()
	if !drain {
		if err := benchkit.Settle(ctx, env.db.Pool); err != nil {
			return 0, 0, err
		}
		if mode == relay.CaptureWAL {
			if err := waitBacklogDone(ctx, env, rc.Slot); err != nil {
				return 0, 0, err
			}
		}
		if err := fillShaped(ctx, env.db.Pool, shape, 0, *bigTxRows); err != nil {
			return 0, 0, err
		}
		start = time.Now()
		if *bigTxProfile != "" {
			f, err := os.Create(fmt.Sprintf("%s.%s.%d", *bigTxProfile, mode, shape.count))
			if err != nil {
				return 0, 0, err
			}
			defer f.Close()
			if err := pprof.StartCPUProfile(f); err == nil {
				defer pprof.StopCPUProfile()
			}
		}
	}
	deadline := time.Now().Add(20 * time.Minute)
	for i := 0; obs.n.Load() < int64(*bigTxRows); i++ {
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("%d of %d rows published in 20 minutes", obs.n.Load(), *bigTxRows)
		}
		if i%20 == 0 {
			peakMem = max(peakMem, goMemory())
		}
		time.Sleep(5 * time.Millisecond)
	}
	return float64(*bigTxRows) / time.Since(start).Seconds(), peakMem, nil
}

// goMemory is the memory the Go runtime holds from the OS (heap, stacks
// and its own) and has not returned: about the process's RSS. The
// benchmark's other runs share the process, so it bounds the relay's.
func goMemory() uint64 {
	sample := []metrics.Sample{{Name: "/memory/classes/total:bytes"}, {Name: "/memory/classes/heap/released:bytes"}}
	metrics.Read(sample)
	return sample[0].Value.Uint64() - sample[1].Value.Uint64()
}

// startAndStop starts a relay once and stops it: a wal relay makes its
// slot and records its backlog done.
func startAndStop(ctx context.Context, env *relayEnv, rc relay.Config) error {
	r, err := benchkit.StartRelay(ctx, env.options(rc))
	if err != nil {
		return err
	}
	if rc.Capture == relay.CaptureWAL {
		if err := waitBacklogDone(ctx, env, rc.Slot); err != nil {
			_ = r.Stop(ctx)
			return err
		}
	}
	return r.Stop(ctx)
}

// waitBacklogDone waits up to 30 s for the wal relay of slot to have made
// its slot and published the backlog before it.
func waitBacklogDone(ctx context.Context, env *relayEnv, slot string) error {
	store := outboxstore.New(env.db.Pool)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		_, done, _, err := store.ReadCapture(ctx, slot) // not done while the slot has no record
		if done || err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the slot %s: its backlog not done within 30s", slot)
		}
	}
}

// shapedInsert inserts events from+1 .. from+n of a shape, numbering them
// itself (the benchmark's user may): the numbering trigger, given one
// aggregate's events by the thousand in one transaction, costs the writer
// quadratically, and this part times the relay.
const shapedInsert = `
WITH ev AS (
    SELECT g, CASE WHEN $3::int = 0 THEN g ELSE g % $3::int + 1 END AS agg,
           CASE WHEN $3::int = 0 THEN 1 ELSE (g - 1) / $3::int + 1 END AS seq
    FROM generate_series($1::bigint + 1, $1::bigint + $2::bigint) AS g
)
INSERT INTO outbox (aggregate_type, aggregate_id, aggregate_seq, event_type, payload)
SELECT 'product', agg::text, seq, 'product.updated',
       jsonb_build_object('product_id', agg, 'version', g, 'price_cents', 1000 + g % 90000)
FROM ev ORDER BY g`

// fillShaped commits events from+1 .. from+n in one transaction, inserted
// a statement per 10,000 (as a bulk import would).
func fillShaped(ctx context.Context, pool *pgxpool.Pool, shape aggregateShape, from, n int) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for k := from; k < from+n; k += 10_000 {
			if err := insertShaped(ctx, tx, shape, k, min(10_000, from+n-k)); err != nil {
				return err
			}
		}
		return nil
	})
}

func insertShaped(ctx context.Context, tx pgx.Tx, shape aggregateShape, from, n int) error {
	if _, err := tx.Exec(ctx, shapedInsert, from, n, shape.count); err != nil {
		return err
	}
	// The counters as the trigger would have left them.
	_, err := tx.Exec(ctx, `
INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq)
SELECT aggregate_type, aggregate_id, max(aggregate_seq) FROM outbox
WHERE id > (SELECT coalesce(max(id), 0) FROM outbox) - $1::bigint
GROUP BY 1, 2
ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = excluded.last_seq`, n)
	return err
}
