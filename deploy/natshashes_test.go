package deploy_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/fanout/fanout/deploy"
	"golang.org/x/crypto/bcrypt"
)

func TestHashNATSPasswords(t *testing.T) {
	from, to := t.TempDir(), t.TempDir()
	passwords := map[string]string{"nats_relay_password": "p" + randomHex(t, 16), "nats_invoicing_password": "p" + randomHex(t, 16) + "\n"}
	for name, pw := range passwords {
		if err := os.WriteFile(filepath.Join(from, name), []byte(pw), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Not a NATS password: left alone.
	if err := os.WriteFile(filepath.Join(from, "pg_relay_password"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	check := func() {
		t.Helper()
		for name, pw := range passwords {
			h, err := os.ReadFile(filepath.Join(to, name+deploy.NATSHashSuffix))
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(string(h), "$2a$") || bcrypt.CompareHashAndPassword(h, []byte(strings.TrimRight(pw, "\n"))) != nil {
				t.Errorf("%s's hash %q does not match its password", name, h)
			}
		}
		if entries, _ := os.ReadDir(to); len(entries) != len(passwords) {
			t.Errorf("%d files written, want %d hashes", len(entries), len(passwords))
		}
	}
	written, err := deploy.HashNATSPasswords(from, to)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(written)
	if want := []string{"nats_invoicing_password.bcrypt", "nats_relay_password.bcrypt"}; !slices.Equal(written, want) {
		t.Errorf("wrote %v, want %v", written, want)
	}
	check()
	// Again: every hash still matches, nothing is written.
	if written, err := deploy.HashNATSPasswords(from, to); err != nil || len(written) != 0 {
		t.Errorf("a second run wrote %v (%v), want nothing", written, err)
	}
	// A password changed: its hash only is written again.
	passwords["nats_relay_password"] = "p" + randomHex(t, 16)
	if err := os.WriteFile(filepath.Join(from, "nats_relay_password"), []byte(passwords["nats_relay_password"]), 0o600); err != nil {
		t.Fatal(err)
	}
	if written, err := deploy.HashNATSPasswords(from, to); err != nil || !slices.Equal(written, []string{"nats_relay_password.bcrypt"}) {
		t.Errorf("after a change: wrote %v (%v), want the relay's hash", written, err)
	}
	check()
	if _, err := deploy.HashNATSPasswords(t.TempDir(), to); err == nil || !strings.Contains(err.Error(), "generate.sh") {
		t.Errorf("no passwords: %v, want an error naming generate.sh", err)
	}
}
