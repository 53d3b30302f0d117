package deploy_test

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/fanout/fanout/deploy"
	"github.com/fanout/fanout/subscribers"
	"github.com/fanout/fanout/subscribers/registry"
)

// The files in deploy/ are what the registry declares: a subscriber added,
// renamed, or given another grant changes them, and this fails until
// `go run ./cmd/fanout deploy render deploy` has written them again.
func TestDeployFilesMatchTheRegistry(t *testing.T) {
	for _, f := range deploy.Files {
		want, err := f.Render(registry.Default.All())
		if err != nil {
			t.Fatal(err)
		}
		path := f.Path
		have, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(have, want) {
			t.Errorf("%s differs from what the subscribers declare (first difference at line %d): run `go run ./cmd/fanout deploy render deploy`",
				path, firstDifference(have, want))
		}
		info, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if info.Mode().Perm() != f.Mode {
			t.Errorf("%s: mode %v, want %v", path, info.Mode().Perm(), f.Mode)
		}
	}
}

func firstDifference(a, b []byte) int {
	la, lb := strings.Split(string(a), "\n"), strings.Split(string(b), "\n")
	for i := range min(len(la), len(lb)) {
		if la[i] != lb[i] {
			return i + 1
		}
	}
	return min(len(la), len(lb)) + 1
}

// A subscriber added to the registry gets its NATS user with its own
// consumer's permissions, its Postgres role with its declared grants and its
// own row-level policies, its compose service with the credentials of the
// services it uses, and its secrets.
func TestANewSubscriberGetsItsDeployment(t *testing.T) {
	extra := subscribers.Declaration{
		Name:       "audit_trail",
		EventTypes: []string{"order.created", "product.>"},
		Uses:       []subscribers.Service{subscribers.Redis},
		Grants:     []string{"SELECT ON orders", "SELECT, INSERT ON audit_entries"},
		Tables:     []string{"audit_entries"},
		New:        func(subscribers.Deps) (subscribers.Handler, error) { return subscribers.Handler{}, nil },
	}
	reg, err := registry.Default.With(extra)
	if err != nil {
		t.Fatal(err)
	}
	render := func(name string, r *registry.Registry) string {
		t.Helper()
		f, err := deploy.Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		out, err := f.Render(r.All())
		if err != nil {
			t.Fatal(err)
		}
		return string(out)
	}
	for _, c := range []struct{ file, want string }{
		{"nats-config", `{user: audit_trail, password: $FANOUT_NATS_AUDIT_TRAIL_PASSWORD, permissions: $AUDIT_TRAIL_PERMISSIONS}`},
		{"nats-config", `"$JS.API.CONSUMER.MSG.NEXT.EVENTS.audit_trail"`},
		{"nats-config", `"$JS.ACK.EVENTS.audit_trail.>"`},
		{"nats-config", `"deadletter.audit_trail.>"`},
		{"nats-config", `{service: {account: DEADLETTER, subject: "$JS.API.INFO"}, to: "$JS.DEADLETTER.API.INFO"}`},
		{"nats-config", `allow: ["_INBOX_audit_trail.>"]`},
		{"postgres-roles", `ALTER ROLE fanout_audit_trail LOGIN NOSUPERUSER`},
		{"postgres-roles", `GRANT SELECT ON orders TO fanout_audit_trail;`},
		{"postgres-roles", `CREATE POLICY fanout_audit_trail_checkpoints ON processed_events TO fanout_audit_trail
    USING (subscriber = 'audit_trail') WITH CHECK (subscriber = 'audit_trail');`},
		{"postgres-roles", `CREATE POLICY fanout_audit_trail_attempts ON subscriber_attempts TO fanout_audit_trail`},
		{"postgres-roles", `\getenv fanout_password FANOUT_PG_AUDIT_TRAIL_PASSWORD`},
		{"postgres-roles", operatorMembership(reg)},
		// Its table: roles.sql waits for it to exist, then hands it to
		// fanout_migrate and grants on it.
		{"postgres-roles", `'order_transitions', 'subscriber_backfills', 'subscriber_backfill_segments', 'subscriber_backfill_failures', 'audit_entries', 'fulfilment_history'`},
		{"postgres-roles", `'order_transitions', 'subscriber_backfills', 'subscriber_backfill_segments', 'subscriber_backfill_failures', 'audit_entries', 'fulfilment_history', 'fulfilment_orders', 'fulfilment_violations', 'product_sales')
  AND c.relowner <> 'fanout_migrate'::regrole`},
		{"postgres-roles", `GRANT SELECT, INSERT ON audit_entries TO fanout_audit_trail;`},
		{"compose", `  audit_trail:
    <<: *fanout
    command: ["subscribe", "audit_trail"]`},
		{"compose", `      FANOUT_NATS_USER: audit_trail
      FANOUT_NATS_PASSWORD_FILE: /run/secrets/nats_audit_trail_password
      FANOUT_NATS_CA_FILE: /run/secrets/nats_ca
      # The dead letters' account, whose share of the store it watches.
      FANOUT_SUBSCRIBERS_DEAD_LETTER_API_PREFIX: $$JS.DEADLETTER.API
      FANOUT_REDIS_PASSWORD_FILE: /run/secrets/redis_password
    secrets: [nats_ca, pg_audit_trail_password, nats_audit_trail_password, redis_password]`},
		{"compose", `export FANOUT_NATS_AUDIT_TRAIL_PASSWORD="$$(cat /nats-hashes/nats_audit_trail_password.bcrypt)"`},
		{"compose", `  pg_audit_trail_password: {file: ./secrets/pg_audit_trail_password}`},
		{"secrets-script", `pg_audit_trail nats_audit_trail \`},
	} {
		if got := render(c.file, reg); !strings.Contains(got, c.want) {
			t.Errorf("%s with the new subscriber lacks\n%s", c.file, c.want)
		}
		if got := render(c.file, registry.Default); strings.Contains(got, "audit_trail") {
			t.Errorf("%s without the new subscriber names it", c.file)
		}
	}
}

// operatorMembership is the line of roles.sql that makes the operator a
// member of every subscriber's role (a redrive runs a subscriber's
// handler), in the registry's order.
func operatorMembership(reg *registry.Registry) string {
	var roles []string
	for _, name := range reg.Names() {
		roles = append(roles, "fanout_"+name)
	}
	return "GRANT " + strings.Join(roles, ", ") + " TO fanout_operator;"
}
