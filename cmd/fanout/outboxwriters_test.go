package main

import (
	"strings"
	"testing"

	"github.com/fanout/fanout/schema/pgtest"
)

// fanout outbox writers lists the declarations, allow and withdraw change
// them and say what changed; a missing reason or an unknown role is
// refused with the reason.
func TestOutboxWritersCommand(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	env := []string{"FANOUT_POSTGRES_URL=" + db.URL}
	steps := []struct {
		args []string
		ok   bool
		want []string
	}{
		{[]string{"outbox", "writers"}, true, []string{"ROLE", "fanout_writer  *", "as before migration 26"}},
		{[]string{"outbox", "writers", "allow", "postgres", "order.created", "order.paid", "--reason", "the order service"}, true,
			[]string{"postgres may write order.created\npostgres may write order.paid\n"}},
		{[]string{"outbox", "writers", "allow", "postgres", "order.paid", "--reason", "again"}, true, []string{"postgres could write order.paid already"}},
		{[]string{"outbox", "writers", "withdraw", "fanout_writer", "*"}, true, []string{"fanout_writer may no longer write *"}},
		{[]string{"outbox", "writers"}, true, []string{"postgres", "order.created", "the order service"}},
		{[]string{"outbox", "writers", "withdraw", "fanout_writer", "*"}, true, []string{"fanout_writer had no declaration for *"}},
		{[]string{"outbox", "writers", "allow", "postgres", "order.paid"}, false, []string{"--reason is required"}},
		{[]string{"outbox", "writers", "allow", "no_such_role_at_all", "order.paid", "--reason", "x"}, false, []string{"no role no_such_role_at_all"}},
	}
	for _, s := range steps {
		out, err := run(t, env, s.args...)
		if (err == nil) != s.ok {
			t.Fatalf("fanout %s: %v, want ok=%t\n%s", strings.Join(s.args, " "), err, s.ok, out)
		}
		for _, w := range s.want {
			if !strings.Contains(out, w) {
				t.Errorf("fanout %s:\n%s\nwant %q", strings.Join(s.args, " "), out, w)
			}
		}
	}
	if out, _ := run(t, env, "outbox", "writers"); strings.Contains(out, "fanout_writer") {
		t.Errorf("fanout_writer still listed after its withdrawal:\n%s", out)
	}
}
