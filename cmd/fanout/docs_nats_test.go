package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// natsCLI checks the docs' nats commands with the nats CLI that
// deploy/versions.env pins, so that the truth about its commands and flags
// is the CLI's own, not a list in this test.
type natsCLI struct {
	path string
	home string // an empty HOME: no person's nats contexts apply
}

// isNatsCLI reports whether a command's first word runs the nats CLI: nats
// on the PATH or the pinned one in .bin/ (nats-server is another program).
func isNatsCLI(w string) bool {
	return w == "nats" || w == ".bin/nats" || strings.HasSuffix(w, "/.bin/nats")
}

// newNatsCLI returns the pinned nats CLI, built into .bin/ if it is not
// there yet. Without it the test fails: a docs test that skipped its nats
// commands would pass the wrong ones.
func newNatsCLI(t *testing.T) *natsCLI {
	t.Helper()
	p := pinnedNatsCLI()
	if p.err != nil {
		t.Fatalf("the pinned nats CLI, needed to check the docs' nats commands: %v", p.err)
	}
	t.Logf("nats CLI %s: %s (deploy/services.sh nats-cli took %v)", p.version, p.path, p.took.Round(time.Millisecond))
	return &natsCLI{path: p.path, home: t.TempDir()}
}

type pinnedCLI struct {
	path, version string
	took          time.Duration
	err           error
}

// pinnedNatsCLI runs `deploy/services.sh nats-cli` once per test binary:
// it returns at once when .bin/nats is the pinned version, waits for a build
// that `go tool task test` or `task up` started in the background (the
// script builds under a lock), or builds it (go install, about 130 s of CPU
// on an empty build cache).
var pinnedNatsCLI = sync.OnceValue(func() pinnedCLI {
	version, err := envFileValue("../../deploy/versions.env", "NATSCLI_VERSION")
	if err != nil {
		return pinnedCLI{err: err}
	}
	path, err := filepath.Abs("../../.bin/nats")
	if err != nil {
		return pinnedCLI{err: err}
	}
	start := time.Now()
	out, err := exec.Command("bash", "../../deploy/services.sh", "nats-cli").CombinedOutput()
	took := time.Since(start)
	if err != nil {
		return pinnedCLI{err: fmt.Errorf("bash deploy/services.sh nats-cli: %v\n%s", err, out)}
	}
	// The binary says which version it is: a stale .bin/nats.version
	// beside another build must not pass.
	got, err := exec.Command(path, "--version").CombinedOutput()
	if err != nil {
		return pinnedCLI{err: fmt.Errorf("%s --version: %v\n%s", path, err, got)}
	}
	if v := strings.TrimSpace(string(got)); v != version {
		return pinnedCLI{err: fmt.Errorf("%s is %s, deploy/versions.env pins %s (deploy/services.sh nats-cli said:\n%s)", path, v, version, out)}
	}
	return pinnedCLI{path: path, version: version, took: took}
})

// envFileValue reads KEY=value from a shell file of assignments.
func envFileValue(path, key string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), key+"="); ok {
			return strings.Trim(v, `"'`), nil
		}
	}
	return "", fmt.Errorf("%s sets no %s", path, key)
}

// check has the CLI parse args as it would to run them, but with --help
// added: its parser (fisk, a kingpin fork) reads the whole line first,
// subcommands with their aliases, flags, flag values and the number of
// arguments, and fails on the first it does not know; only then does it
// print the resolved command's help instead of running it. A group
// (`nats stream`) parses too, and only prints its subcommands: that is an
// error here, as for fanout's groups.
func (n *natsCLI) check(args []string) error {
	help, rejected, err := n.help(args)
	if err != nil {
		return err
	}
	if rejected != "" {
		return fmt.Errorf("the pinned nats CLI rejects it: %s%s", rejected, n.hint(args, rejected))
	}
	usage, _, _ := strings.Cut(help, "\n")
	path, ok := natsUsagePath(usage)
	if !ok {
		return fmt.Errorf("the pinned nats CLI's help starts %q, not with its usage: the check cannot tell what it accepted", usage)
	}
	if strings.Contains(usage, "<command>") {
		return fmt.Errorf("%q is not a command by itself: name one of its subcommands (%s)", path, strings.Join(natsSubcommands(help), ", "))
	}
	return nil
}

// help runs the CLI on args with --help added, and returns the help it
// printed, or what it rejected.
func (n *natsCLI) help(args []string) (help, rejected string, err error) {
	i := slices.Index(args, "--")
	if i < 0 {
		i = len(args)
	}
	cmd := exec.Command(n.path, slices.Concat(args[:i], []string{"--help"}, args[i:])...)
	// No server to reach and no contexts: help never connects, and
	// should anything run, it runs against nothing.
	cmd.Env = []string{"HOME=" + n.home, "XDG_CONFIG_HOME=" + n.home, "NATS_URL=nats://127.0.0.1:1"}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return "", natsError(stderr.String()), nil
	}
	if err != nil {
		return "", "", fmt.Errorf("run %s: %w", n.path, err)
	}
	// A deprecated command still parses; natscli says so on stderr.
	if w, _, _ := strings.Cut(strings.TrimSpace(stderr.String()), "\n"); strings.Contains(w, "deprecated") {
		return "", w, nil
	}
	return stdout.String(), "", nil
}

var (
	natsUnknownCommandRE = regexp.MustCompile(`^expected command but got "(.*)"`)
	natsUnknownFlagRE    = regexp.MustCompile(`^unknown (?:long|short) flag '(-[^']+)'`)
)

// hint says what the CLI would have taken where it stopped: the
// subcommands of the group before an unknown one, or the flags of the
// command before an unknown flag (its own, not the global ones).
func (n *natsCLI) hint(args []string, rejected string) string {
	var at func(string) bool
	var list func(string) []string
	if m := natsUnknownCommandRE.FindStringSubmatch(rejected); m != nil {
		at = func(a string) bool { return a == m[1] }
		list = natsSubcommands
	} else if m := natsUnknownFlagRE.FindStringSubmatch(rejected); m != nil {
		at = func(a string) bool {
			return a == m[1] || strings.HasPrefix(a, m[1]+"=") || !strings.HasPrefix(m[1], "--") && strings.HasPrefix(a, m[1])
		}
		list = natsFlags
	} else {
		return ""
	}
	i := slices.IndexFunc(args, at)
	if i < 0 {
		return ""
	}
	help, rejected, err := n.help(args[:i])
	if err != nil || rejected != "" {
		return ""
	}
	usage, _, _ := strings.Cut(help, "\n")
	path, _ := natsUsagePath(usage)
	return fmt.Sprintf(" (%s has: %s)", path, strings.Join(list(help), ", "))
}

// natsError returns fisk's error line from the CLI's stderr
// ("error: unknown long flag '--last'"), without its advice to ask for help.
func natsError(stderr string) string {
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	for _, l := range lines {
		if msg, ok := strings.CutPrefix(l, "error: "); ok {
			return strings.TrimSuffix(msg, ", use --help for full help including flags and arguments")
		}
	}
	return strings.Join(lines, " / ")
}

// natsUsagePath returns the command path of fisk's usage line:
// "usage: nats stream view [<flags>] [<stream>] [<size>]" says
// "nats stream view", the canonical names whatever alias the doc used.
func natsUsagePath(usage string) (string, bool) {
	rest, ok := strings.CutPrefix(usage, "usage: ")
	if !ok {
		return "", false
	}
	var path []string
	for _, w := range strings.Fields(rest) {
		if strings.ContainsAny(w, "[<") {
			break
		}
		path = append(path, w)
	}
	return strings.Join(path, " "), len(path) > 0
}

// natsFlagRE finds each flag's long name in fisk's help lines
// ("  -S, --last-for=SUBJECT  Retrieves ...", "  --[no-]pem ...").
var natsFlagRE = regexp.MustCompile(`^\s+(?:-\w, )?--(\[no-\])?([\w-]+)`)

// natsFlags returns the flags under the help's "Flags:" heading: the
// command's own (and at the top level, the global ones).
func natsFlags(help string) []string {
	var names []string
	in := false
	for _, line := range strings.Split(help, "\n") {
		switch {
		case line == "Flags:":
			in = true
		case in && line == "":
			return names
		case in:
			if m := natsFlagRE.FindStringSubmatch(line); m != nil {
				names = append(names, "--"+m[1]+m[2])
			}
		}
	}
	return names
}

// natsSubcommands returns the subcommands a group's help lists, under
// "Commands:" (the top level) or "Subcommands:", one a line as
// "  stream add       Create a new stream".
func natsSubcommands(help string) []string {
	var names []string
	in := false
	for _, line := range strings.Split(help, "\n") {
		switch {
		case line == "Commands:" || line == "Subcommands:":
			in = true
		case in && line == "":
			return names
		case in && strings.HasPrefix(line, "  ") && !strings.HasPrefix(line, "   "):
			first, _, _ := strings.Cut(strings.TrimSpace(line), "  ")
			words := strings.Fields(first)
			names = append(names, words[len(words)-1])
		}
	}
	return names
}
