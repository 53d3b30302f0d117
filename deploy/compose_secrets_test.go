package deploy_test

import (
	"encoding/base64"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// TestComposeKeepsPasswordsOffCommandLines runs the shell commands of
// compose.yaml that handle passwords (the search engine's users and its
// health check, Redis and its health check) as written, with the secrets
// in a directory of the test's, the search engine replaced by a local
// server, and curl, redis-server and redis-cli by shims that record their
// arguments (and then run curl, or answer as Redis would). Every
// password reaches its program, and none is in any program's arguments:
// any user of the host sees a container's command lines.
func TestComposeKeepsPasswordsOffCommandLines(t *testing.T) {
	p := loadCompose(t)
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Fatalf("curl is needed to run the compose commands that call it: %v", err)
	}
	dir := t.TempDir()
	secrets, bin := filepath.Join(dir, "secrets"), filepath.Join(dir, "bin")
	for _, d := range []string{secrets, bin} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	passwords := map[string]string{}
	for _, name := range []string{"es", "es_searchindex", "redis"} {
		passwords[name] = "p" + randomHex(t, 16)
		if err := os.WriteFile(filepath.Join(secrets, name+"_password"), []byte(passwords[name]), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	argv := filepath.Join(dir, "argv")
	shim := func(name, body string) {
		script := "#!/bin/sh\nprintf '%s\\n' \"" + name + " $*\" >>" + argv + "\n" + body + "\n"
		if err := os.WriteFile(filepath.Join(bin, name), []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	shim("curl", `exec `+curl+` "$@"`)
	shim("redis-server", `if [ -f "$1" ]; then cp "$1" `+filepath.Join(dir, "redis.conf.seen")+`; stat -c %a "$1" >`+filepath.Join(dir, "redis.conf.mode")+`; fi`)
	// Redis answers PONG to its password, however it is given.
	shim("redis-cli", `case "$REDISCLI_AUTH $*" in *`+passwords["redis"]+`*) echo PONG ;; esac`)

	var mu sync.Mutex
	var requests []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		requests = append(requests, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization")+" "+string(body))
		mu.Unlock()
		_, _ = w.Write([]byte(`{"status":"green"}`))
	}))
	defer srv.Close()

	run := func(what, script string) {
		t.Helper()
		script = strings.NewReplacer("/run/secrets", secrets, "http://elasticsearch:9200", srv.URL, "http://127.0.0.1:9200", srv.URL,
			"/tmp/redis.conf", filepath.Join(dir, "redis.conf")).Replace(script)
		cmd := exec.Command("sh", "-c", script)
		cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", what, err, out)
		}
	}
	service := func(name string) (command, health string) {
		t.Helper()
		s, err := p.GetService(name)
		if err != nil {
			t.Fatal(err)
		}
		if len(s.Command) > 0 {
			command = s.Command[0]
		}
		if s.HealthCheck != nil && len(s.HealthCheck.Test) == 2 && s.HealthCheck.Test[0] == "CMD-SHELL" {
			health = s.HealthCheck.Test[1]
		}
		return command, health
	}
	roles, _ := service("elasticsearch-roles")
	_, esHealth := service("elasticsearch")
	redis, redisHealth := service("redis")
	for _, s := range []struct{ what, script string }{
		{"elasticsearch-roles", roles}, {"the search engine's health check", esHealth},
		{"redis", redis}, {"redis's health check", redisHealth},
	} {
		if s.script == "" {
			t.Fatalf("%s: no shell command in compose.yaml", s.what)
		}
		run(s.what, s.script)
	}

	superuser := "Basic " + base64.StdEncoding.EncodeToString([]byte("elastic:"+passwords["es"]))
	if len(requests) != 3 {
		t.Fatalf("the search engine got %d requests, want the role, the user and the health check:\n%s", len(requests), strings.Join(requests, "\n"))
	}
	for _, r := range requests {
		if !strings.Contains(r, superuser) {
			t.Errorf("request without the superuser's credentials: %s", r)
		}
	}
	if want := `{"password": "` + passwords["es_searchindex"] + `", "roles": ["fanout_searchindex"]}`; !strings.HasSuffix(requests[1], want) {
		t.Errorf("the user's creation: %s\nwant the body %s", requests[1], want)
	}
	conf, err := os.ReadFile(filepath.Join(dir, "redis.conf.seen"))
	if err != nil || !strings.Contains(string(conf), "requirepass "+passwords["redis"]+"\n") {
		t.Errorf("redis-server's configuration: %q (%v), want the password in it", conf, err)
	}
	if mode, _ := os.ReadFile(filepath.Join(dir, "redis.conf.mode")); strings.TrimSpace(string(mode)) != "600" {
		t.Errorf("redis-server's configuration file has mode %q, want 600 (its user's only)", mode)
	}

	args, err := os.ReadFile(argv)
	if err != nil {
		t.Fatal(err)
	}
	for name, pw := range passwords {
		if strings.Contains(string(args), pw) {
			t.Errorf("the %s password is on a command line:\n%s", name, args)
		}
	}
	t.Logf("command lines:\n%s", args)
}
