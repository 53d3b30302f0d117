package benchkit

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// CPUTimes is the CPU time (user and system) used so far by this process,
// the local nats-server, and the local Postgres (the postmaster, every
// backend and walsender alive, and those already gone).
type CPUTimes struct {
	Self, NATS, Postgres time.Duration
}

// Sub returns the CPU time used between earlier and t.
func (t CPUTimes) Sub(earlier CPUTimes) CPUTimes {
	return CPUTimes{Self: t.Self - earlier.Self, NATS: t.NATS - earlier.NATS, Postgres: t.Postgres - earlier.Postgres}
}

// CPUClock reads CPUTimes from /proc: the benchmarks run on the machine
// that runs the services (deploy/services.sh), so the servers' counters
// are this machine's to read.
type CPUClock struct {
	natsPID, postmasterPID int
}

// userHZ is the unit of /proc's CPU times (sysconf(_SC_CLK_TCK), 100 on
// every Linux this runs on).
const userHZ = 100

// NewCPUClock finds the nats-server serving natsURL and the postmaster of
// the server pool is connected to.
func NewCPUClock(ctx context.Context, pool *pgxpool.Pool, natsURL string) (*CPUClock, error) {
	natsPID, err := findNATSServer(natsURL)
	if err != nil {
		return nil, err
	}
	var backend int
	if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		return nil, err
	}
	st, err := procStat(backend)
	if err != nil {
		return nil, fmt.Errorf("postgres is not on this machine (backend %d): %w", backend, err)
	}
	return &CPUClock{natsPID: natsPID, postmasterPID: st.ppid}, nil
}

// Read returns the CPU times used so far.
func (c *CPUClock) Read() (CPUTimes, error) {
	var t CPUTimes
	self, err := procStat(os.Getpid())
	if err != nil {
		return t, err
	}
	t.Self = self.cpu
	ns, err := procStat(c.natsPID)
	if err != nil {
		return t, fmt.Errorf("nats-server: %w", err)
	}
	t.NATS = ns.cpu
	pm, err := procStat(c.postmasterPID)
	if err != nil {
		return t, fmt.Errorf("postmaster: %w", err)
	}
	// Reaped children's time is in the postmaster's own counters; live
	// children's is in theirs.
	t.Postgres = pm.cpu + pm.childrenCPU
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return t, err
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := procStat(pid)
		if err != nil || st.ppid != c.postmasterPID {
			continue // gone meanwhile, or not Postgres's
		}
		t.Postgres += st.cpu
	}
	return t, nil
}

type stat struct {
	ppid             int
	cpu, childrenCPU time.Duration
}

func procStat(pid int) (stat, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return stat{}, err
	}
	// The command name, in parentheses, may hold spaces: fields count from
	// after its closing parenthesis (field 3, the state, is f[0]).
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 15 {
		return stat{}, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	n := func(i int) int64 { v, _ := strconv.ParseInt(f[i], 10, 64); return v }
	ticks := func(v int64) time.Duration { return time.Duration(v) * time.Second / userHZ }
	return stat{ppid: int(n(1)), cpu: ticks(n(11) + n(12)), childrenCPU: ticks(n(13) + n(14))}, nil
}

// findNATSServer returns the pid of the nats-server process started with
// the port of natsURL (deploy/services.sh starts it with -p), or of the
// only nats-server running.
func findNATSServer(natsURL string) (int, error) {
	u, err := url.Parse(natsURL)
	if err != nil {
		return 0, err
	}
	port := u.Port()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	var all, onPort []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if filepath.Base(args[0]) != "nats-server" {
			continue
		}
		all = append(all, pid)
		for i := 1; i < len(args)-1; i++ {
			if (args[i] == "-p" || args[i] == "--port") && args[i+1] == port {
				onPort = append(onPort, pid)
			}
		}
	}
	switch {
	case len(onPort) == 1:
		return onPort[0], nil
	case len(onPort) == 0 && len(all) == 1:
		return all[0], nil
	case len(all) == 0:
		return 0, errors.New("no nats-server process on this machine")
	}
	return 0, fmt.Errorf("%d nats-server processes, none alone started with -p %s", len(all), port)
}
