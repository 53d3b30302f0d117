package deploy_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
)

var (
	fanoutOnce sync.Once
	fanoutBin  string
	fanoutErr  error
)

// fanout runs the real binary (built once) and returns its output.
func fanout(t *testing.T, args ...string) (string, error) {
	t.Helper()
	fanoutOnce.Do(func() {
		dir, err := os.MkdirTemp("", "fanout-deploy-test-")
		if err != nil {
			fanoutErr = err
			return
		}
		fanoutBin = filepath.Join(dir, "fanout")
		if out, err := exec.Command("go", "build", "-o", fanoutBin, "../cmd/fanout").CombinedOutput(); err != nil {
			fanoutErr = err
			t.Logf("%s", out)
		}
	})
	if fanoutErr != nil {
		t.Fatalf("build fanout: %v", fanoutErr)
	}
	out, err := exec.Command(fanoutBin, args...).CombinedOutput()
	return string(out), err
}

// loadCompose parses compose.yaml the way `docker compose config` does
// (compose-go is the library behind it): schema validation, interpolation,
// anchors and merges, and the consistency checks.
func loadCompose(t *testing.T) *types.Project {
	t.Helper()
	wd, _ := os.Getwd()
	return loadComposeIn(t, wd)
}

// loadComposeIn parses the compose.yaml in dir.
func loadComposeIn(t *testing.T, wd string) *types.Project {
	t.Helper()
	p, err := loader.LoadWithContext(context.Background(), types.ConfigDetails{
		WorkingDir:  wd,
		ConfigFiles: []types.ConfigFile{{Filename: filepath.Join(wd, "compose.yaml")}},
		Environment: types.Mapping{},
	}, func(o *loader.Options) { o.SetProjectName("fanout", true) })
	if err != nil {
		t.Fatalf("compose.yaml does not parse: %v", err)
	}
	return p
}

func TestComposeParses(t *testing.T) {
	p := loadCompose(t)
	for _, want := range []string{"postgres", "nats", "redis", "elasticsearch", "migrate", "relay", "invoicing", "cacheinval", "searchindex", "salesledger"} {
		if _, err := p.GetService(want); err != nil {
			t.Errorf("service %s: %v", want, err)
		}
	}
	for name, s := range p.Services {
		if s.Restart == "" {
			t.Errorf("service %s has no restart policy", name)
		}
		if s.Restart != "no" && s.HealthCheck == nil {
			t.Errorf("long-running service %s has no health check", name)
		}
	}
}

// Every fanout service runs a real subcommand (a real subscriber for
// `subscribe`), every FANOUT_ variable it sets is a real config key, and
// every secret file it names is one it mounts.
func TestComposeCommandsAndVariablesAreReal(t *testing.T) {
	p := loadCompose(t)
	keys, err := fanout(t, "config", "keys")
	if err != nil {
		t.Fatalf("fanout config keys: %v\n%s", err, keys)
	}
	envNames := map[string]bool{}
	for _, line := range strings.Split(keys, "\n") {
		if f := strings.Fields(line); len(f) == 2 {
			envNames[f[1]] = true
		}
	}
	subscribeHelp, _ := fanout(t, "subscribe", "--help")
	checked := 0
	for name, s := range p.Services {
		if s.Image != "fanout:latest" {
			continue
		}
		checked++
		if len(s.Command) == 0 {
			t.Errorf("service %s: no command", name)
			continue
		}
		if out, err := fanout(t, s.Command[0], "--help"); err != nil || strings.Contains(out, "unknown command") {
			t.Errorf("service %s: command %q is not a fanout subcommand: %v\n%s", name, s.Command[0], err, out)
		}
		if s.Command[0] == "subscribe" {
			for _, sub := range s.Command[1:] {
				if !strings.Contains(subscribeHelp, sub) {
					t.Errorf("service %s subscribes %q, which fanout does not know", name, sub)
				}
			}
		}
		for k, v := range s.Environment {
			if strings.HasPrefix(k, "FANOUT_") && !envNames[k] {
				t.Errorf("service %s sets %s, which is no config key", name, k)
			}
			if secret, ok := strings.CutPrefix(derefOr(v), "/run/secrets/"); ok &&
				!slices.ContainsFunc(s.Secrets, func(m types.ServiceSecretConfig) bool { return m.Source == secret }) {
				t.Errorf("service %s reads %s from %s, a secret it does not mount", name, k, *v)
			}
		}
		if !slices.Contains(s.HealthCheck.Test, "healthcheck") && s.Restart != "no" {
			t.Errorf("service %s does not probe itself with `fanout healthcheck`: %v", name, s.HealthCheck.Test)
		}
	}
	if checked < 5 {
		t.Errorf("only %d services run the fanout image", checked)
	}
}

func derefOr(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
