package main

// What JetStream's fsync policy costs (part fsync): the relay's drain and
// raw async publishes against a nats-server with the default
// sync_interval (2 minutes: a PubAck comes before the disk has it) and one
// with sync_interval always (every write synced before its PubAck), each
// server started for the run with a store of its own.

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/fanout/fanout/bench/benchkit"
	"github.com/fanout/fanout/internal/testenv/natstest"
	"github.com/nats-io/nats.go"
)

var fsyncRows = flag.Int("fsyncrows", 20_000, "rows of the fsync part's drains and raw publishes (synced writes are slow)")

// benchFsync runs on servers of its own, not nc's.
func benchFsync(ctx context.Context, _ *nats.Conn) error {
	saved := *rows
	*rows = *fsyncRows
	defer func() { *rows = saved }()
	policies := []struct{ name, conf string }{
		{"sync_interval 2m (the default)", "jetstream { sync_interval: \"2m\" }\n"},
		{"sync_interval always", "jetstream { sync_interval: always }\n"},
	}
	drains := make([]benchkit.Figure, len(policies))
	raws := make([]benchkit.Figure, len(policies))
	var drainRatio, rawRatio benchkit.Figure
	for run := range *benchkit.Runs {
		var d, r [2]float64
		for i, p := range policies {
			dr, rr, err := onServer(ctx, p.conf)
			if err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
			d[i], r[i] = dr, rr
			drains[i].Add(dr)
			raws[i].Add(rr)
		}
		drainRatio.Add(d[1] / d[0])
		rawRatio.Add(r[1] / r[0])
		fmt.Printf("    run %d of %d: drain %.0f / %.0f rows/s, raw %.0f / %.0f msgs/s (2m / always)\n", run+1, *benchkit.Runs, d[0], d[1], r[0], r[1])
	}
	for i, p := range policies {
		fmt.Printf("(fsync) %s: drain of %d rows %s; raw async publish %s\n", p.name, *rows, drains[i].Format("%.0f rows/s"), raws[i].Format("%.0f msgs/s"))
	}
	fmt.Printf("(fsync) always against 2m: drain %s, raw %s\n\n", drainRatio.Format("%.2f"), rawRatio.Format("%.2f"))
	return nil
}

// onServer starts a nats-server with the configuration conf, and runs part
// a's drain and part c's raw publishes against it.
func onServer(ctx context.Context, conf string) (drain, raw float64, err error) {
	dir, err := os.MkdirTemp("", "fanout-bench-fsync-")
	if err != nil {
		return 0, 0, err
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "nats.conf")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		return 0, 0, err
	}
	srv, err := natstest.StartServer(dir, natstest.WithArgs("-c", path))
	if err != nil {
		return 0, 0, err
	}
	defer srv.Close()
	nc, err := nats.Connect(srv.URL, nats.ReconnectBufSize(-1))
	if err != nil {
		return 0, 0, err
	}
	defer nc.Close()
	d, err := benchDrain(ctx, nc)
	if err != nil {
		return 0, 0, err
	}
	r, err := benchRaw(ctx, nc)
	if err != nil {
		return 0, 0, err
	}
	return d.rate, r.rate, nil
}
