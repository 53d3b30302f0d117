package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/childproc"
	"github.com/fanout/fanout/internal/testenv/syncbuf"
	"github.com/fanout/fanout/subscribers/subscribertest"
)

// process is one running fanout role.
type process struct {
	name string
	cmd  *exec.Cmd
	out  syncbuf.Buffer
	done chan error
}

func (p *process) output() string { return p.out.String() }

// start runs `fanout args...` with the given FANOUT_ settings (and none from
// the test's own environment).
func start(t *testing.T, env []string, args ...string) *process {
	t.Helper()
	p := &process{name: strings.Join(args, " "), done: make(chan error, 1)}
	p.cmd = exec.Command(binary, args...)
	childproc.Tie(p.cmd)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FANOUT_") {
			p.cmd.Env = append(p.cmd.Env, kv)
		}
	}
	p.cmd.Env = append(p.cmd.Env, env...)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("output of fanout %s:\n%s", p.name, p.output())
		}
	})
	return p
}

// runUntil runs `fanout args...` until it says says (a role that cannot
// reach a service waits for it, logging each try, and is stopped then) or
// exits, within 60 s, and returns its output and whether it said it.
func runUntil(t *testing.T, env []string, says string, args ...string) (out string, said bool) {
	t.Helper()
	p := start(t, env, args...)
	deadline := time.After(60 * time.Second)
	for {
		select {
		case err := <-p.done:
			p.done <- err // for the cleanup
			return p.output(), strings.Contains(p.output(), says)
		case <-deadline:
			_ = p.cmd.Process.Kill()
			return p.output(), strings.Contains(p.output(), says)
		case <-time.After(100 * time.Millisecond):
			if strings.Contains(p.output(), says) {
				_ = p.terminate(t, 30*time.Second)
				return p.output(), true
			}
		}
	}
}

// terminate sends SIGTERM and returns the exit error.
func (p *process) terminate(t *testing.T, within time.Duration) error {
	t.Helper()
	return p.stopWith(t, syscall.SIGTERM, within)
}

// stopWith sends sig and returns the exit error.
func (p *process) stopWith(t *testing.T, sig os.Signal, within time.Duration) error {
	t.Helper()
	_ = p.cmd.Process.Signal(sig)
	select {
	case err := <-p.done:
		p.done <- err // for the cleanup
		return err
	case <-time.After(within):
		t.Fatalf("fanout %s did not exit within %s of %s", p.name, within, sig)
		return nil
	}
}

// logLine is the part of a JSON log line the tests read.
type logLine struct {
	Msg        string `json:"msg"`
	Addr       string `json:"addr"`
	Subscriber string `json:"subscriber"`
	Events     int    `json:"events"`
}

// logLines returns the process's JSON log lines so far.
func (p *process) logLines() []logLine {
	var lines []logLine
	sc := bufio.NewScanner(strings.NewReader(p.output()))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var line logLine
		if json.Unmarshal(sc.Bytes(), &line) == nil {
			lines = append(lines, line)
		}
	}
	return lines
}

// opsAddr waits for the process's "operations endpoint listening" line and
// returns the address.
func (p *process) opsAddr(t *testing.T) string {
	t.Helper()
	var addr string
	subscribertest.WaitFor(t, 20*time.Second, "the operations endpoint of "+p.name, func() (bool, string) {
		for _, line := range p.logLines() {
			if line.Msg == "operations endpoint listening" {
				addr = line.Addr
				return true, ""
			}
		}
		return false, ""
	})
	return addr
}

// get fetches a path of the process's operations endpoint.
func get(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	res, err := c.Get("http://" + addr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// waitStarted waits until the process logged that subscriber's start (its
// consumer exists and it is pulling).
func (p *process) waitStarted(t *testing.T, subscriber string) {
	t.Helper()
	subscribertest.WaitFor(t, 30*time.Second, subscriber+" started in "+p.name, func() (bool, string) {
		for _, line := range p.logLines() {
			if line.Msg == "subscriber started" && line.Subscriber == subscriber {
				return true, ""
			}
		}
		return false, ""
	})
}

// handled sums the events a process's "batch handled" log lines report
// for a subscriber.
func (p *process) handled(subscriber string) int {
	n := 0
	for _, line := range p.logLines() {
		if line.Msg == "batch handled" && line.Subscriber == subscriber {
			n += line.Events
		}
	}
	return n
}
