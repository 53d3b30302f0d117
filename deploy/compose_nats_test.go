package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fanout/fanout/internal/testenv/testca"
	"golang.org/x/crypto/bcrypt"
)

// The NATS server's container gets its users' password hashes, never a
// password: compose.yaml's nats-hashes job (the fanout image) hashes the
// password files into a volume, and the server's command reads the hashes
// from there into its environment. Run as compose writes them, with the
// directories of the test's and nats-server replaced by a shim that
// records its environment and arguments: each variable holds the bcrypt
// hash of its user's password, and no password is anywhere the server
// sees. The server's certificate and key are its only secrets, those
// secrets/generate.sh makes: the real server, run with them and the
// hashes, lets every user in over TLS checked against generate.sh's CA.
func TestComposeGivesTheNATSServerOnlyHashes(t *testing.T) {
	p := loadCompose(t)
	hasher, err := p.GetService("nats-hashes")
	if err != nil {
		t.Fatal(err)
	}
	server, err := p.GetService("nats")
	if err != nil {
		t.Fatal(err)
	}
	for _, sec := range server.Secrets {
		if sec.Source != "nats_tls_cert" && sec.Source != "nats_tls_key" {
			t.Errorf("the nats service mounts secret %s: it needs the hashes and its certificate only", sec.Source)
		}
	}
	for v, want := range map[string]string{"FANOUT_NATS_TLS_CERT_FILE": "/run/secrets/nats_tls_cert", "FANOUT_NATS_TLS_KEY_FILE": "/run/secrets/nats_tls_key"} {
		if got := server.Environment[v]; got == nil || *got != want {
			t.Errorf("the nats service's %s is %v, want %s", v, got, want)
		}
	}
	if d, ok := server.DependsOn["nats-hashes"]; !ok || d.Condition != "service_completed_successfully" {
		t.Errorf("the nats service depends on %v, want nats-hashes completed", server.DependsOn)
	}
	readOnly := false
	for _, v := range server.Volumes {
		readOnly = readOnly || (v.Source == "nats-hashes" && v.Target == "/nats-hashes" && v.ReadOnly)
	}
	if !readOnly {
		t.Errorf("the nats service's volumes %v: want nats-hashes at /nats-hashes, read-only", server.Volumes)
	}

	dir := t.TempDir()
	secrets, hashes, bin := filepath.Join(dir, "secrets"), filepath.Join(dir, "hashes"), filepath.Join(dir, "bin")
	for _, d := range []string{secrets, hashes, bin} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	passwords := map[string]string{} // by variable: FANOUT_NATS_RELAY_PASSWORD
	for _, s := range hasher.Secrets {
		user := strings.TrimSuffix(strings.TrimPrefix(s.Source, "nats_"), "_password")
		pw := "p" + randomHex(t, 16)
		passwords["FANOUT_NATS_"+strings.ToUpper(user)+"_PASSWORD"] = pw
		if err := os.WriteFile(filepath.Join(secrets, s.Source), []byte(pw), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if len(passwords) < 6 {
		t.Fatalf("nats-hashes mounts %d NATS passwords, want every NATS user's", len(passwords))
	}
	// The rest of the secrets, the certificates among them, as an
	// operator makes them (the passwords above are kept).
	generate(t, secrets)
	replace := strings.NewReplacer("/run/secrets", secrets, "/nats-hashes", hashes)
	var args []string
	for _, a := range hasher.Command {
		args = append(args, replace.Replace(a))
	}
	if out, err := fanout(t, args...); err != nil {
		t.Fatalf("nats-hashes (fanout %s): %v\n%s", strings.Join(args, " "), err, out)
	}

	seen := filepath.Join(dir, "seen")
	shim := "#!/bin/sh\n{ printf 'args %s\\n' \"$*\"; env | grep '^FANOUT_NATS_'; } >" + seen + "\n"
	if err := os.WriteFile(filepath.Join(bin, "nats-server"), []byte(shim), 0o755); err != nil {
		t.Fatal(err)
	}
	if len(server.Command) != 1 {
		t.Fatalf("the nats service's command: %q, want one shell script", server.Command)
	}
	cmd := exec.Command("sh", "-c", replace.Replace(server.Command[0]))
	cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the nats service's command: %v\n%s", err, out)
	}
	got, err := os.ReadFile(seen)
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(got)), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			env[k] = v
		}
	}
	for v, h := range env {
		if _, ok := passwords[v]; strings.HasSuffix(v, "_PASSWORD") && !ok {
			t.Errorf("the server gets %s=%q, whose password nats-hashes does not mount", v, h)
		}
	}
	// The server the shipped configuration makes of these hashes lets
	// each user in with its password, the administrators included.
	plain, hashed := map[string]string{}, map[string]string{}
	for v, pw := range passwords {
		user := strings.ToLower(strings.TrimSuffix(strings.TrimPrefix(v, "FANOUT_NATS_"), "_PASSWORD"))
		plain[user], hashed[user] = pw, env[v]
	}
	tls := testca.Pair{CertFile: filepath.Join(secrets, "nats_tls_cert"), KeyFile: filepath.Join(secrets, "nats_tls_key"),
		CAFile: filepath.Join(secrets, "nats_ca")}
	ns := startNATSServer(t, natsConfPath(t), plain, hashed, tls)
	for user := range plain {
		ns.connect(t, user).nc.Close()
	}
	for v, pw := range passwords {
		if strings.Contains(string(got), pw) {
			t.Errorf("the server sees %s's password", v)
		}
		if h := env[v]; !strings.HasPrefix(h, "$2a$") || bcrypt.CompareHashAndPassword([]byte(h), []byte(pw)) != nil {
			t.Errorf("%s=%q: want the bcrypt hash of its password", v, h)
		}
	}
}
