package chaos

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/repo"
)

// TestChaos is the fault-injection run, once on a single nats-server and
// once on a three-node JetStream cluster. FANOUT_TEST_CHAOS_DURATION sets
// the load-and-faults time of each (default 40s; `go tool task chaos` runs
// 10m), FANOUT_TEST_CHAOS_SEED the fault schedule (default 1), and
// FANOUT_TEST_CHAOS_MODE=single or cluster runs one of them.
func TestChaos(t *testing.T) {
	duration := 40 * time.Second
	if d, err := time.ParseDuration(os.Getenv("FANOUT_TEST_CHAOS_DURATION")); err == nil {
		duration = d
	}
	seed := uint64(1)
	if s, err := strconv.ParseUint(os.Getenv("FANOUT_TEST_CHAOS_SEED"), 10, 64); err == nil {
		seed = s
	}
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "fanout")
	if out, err := exec.Command("go", "build", "-o", bin, filepath.Join(root, "cmd/fanout")).CombinedOutput(); err != nil {
		t.Fatalf("build fanout: %v\n%s", err, out)
	}
	for _, mode := range []string{"single", "cluster"} {
		if m := os.Getenv("FANOUT_TEST_CHAOS_MODE"); m != "" && m != mode {
			continue
		}
		t.Run(mode, func(t *testing.T) {
			rep := Run(t, Options{Duration: duration, Seed: seed, Cluster: mode == "cluster", Rate: 40, Binary: bin, Logf: t.Logf})
			t.Log("\n" + rep.String())
			if !rep.Pass() {
				t.Errorf("invariant violated: %s", rep.Violations[0])
			}
		})
	}
}
