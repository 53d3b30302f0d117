package childproc_test

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/childproc"
)

// TestMain doubles as the parent killed in TestTiedChildDiesWithItsParent:
// it starts a tied child, says its pid, and waits to be killed.
func TestMain(m *testing.M) {
	if os.Getenv("CHILDPROC_TEST_PARENT") == "" {
		os.Exit(m.Run())
	}
	cmd := exec.Command("sleep", "300")
	if os.Getenv("CHILDPROC_TEST_PARENT") == "tied" {
		childproc.Tie(cmd)
	}
	if err := cmd.Start(); err != nil {
		fmt.Println("error", err)
		os.Exit(1)
	}
	fmt.Println(cmd.Process.Pid)
	time.Sleep(5 * time.Minute)
}

// A process killed without cleaning up takes its tied children with it;
// untied, they stay (the orphans a killed fault run once left).
func TestTiedChildDiesWithItsParent(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the parent-death signal is Linux's")
	}
	for _, c := range []struct {
		mode     string
		survives bool
	}{{"tied", false}, {"untied", true}} {
		t.Run(c.mode, func(t *testing.T) {
			parent := exec.Command(os.Args[0], "-test.run=^$")
			parent.Env = append(os.Environ(), "CHILDPROC_TEST_PARENT="+c.mode)
			out, err := parent.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := parent.Start(); err != nil {
				t.Fatal(err)
			}
			line, err := bufio.NewReader(out).ReadString('\n')
			pid, perr := strconv.Atoi(strings.TrimSpace(line))
			if err != nil || perr != nil {
				_ = parent.Process.Kill()
				t.Fatalf("the parent said %q (%v, %v), want its child's pid", line, err, perr)
			}
			t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
			_ = parent.Process.Kill()
			_ = parent.Wait()
			deadline := time.Now().Add(5 * time.Second)
			for alive(pid) && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			if alive(pid) != c.survives {
				t.Fatalf("child %d alive %t after its parent was killed, want %t", pid, alive(pid), c.survives)
			}
		})
	}
}

// alive reports whether pid runs (a zombie, dead but not reaped, does not).
func alive(pid int) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	_, rest, _ := strings.Cut(string(b), ") ")
	return !strings.HasPrefix(rest, "Z")
}
