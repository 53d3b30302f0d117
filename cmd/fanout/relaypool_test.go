package main

import (
	"context"
	"testing"
	"time"

	"github.com/fanout/fanout/schema/pgtest"
)

// The relay's sessions plan without JIT: a claim by transactions over a
// few dozen outbox ranges spent most of a second compiling its plan (a
// fault run's claims outlasted their lease), and commit without waiting
// for the WAL flush.
func TestRelaySessions(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	cfg, err := loadConfig("", []string{"FANOUT_POSTGRES_URL=" + db.URL})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a := &app{cfg: cfg}
	pool, err := a.postgres(ctx, "relay", relaySessions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for setting, want := range map[string]string{"jit": "off", "synchronous_commit": "off", "application_name": "fanout-relay"} {
		var got string
		if err := pool.QueryRow(ctx, "SELECT current_setting($1)", setting).Scan(&got); err != nil || got != want {
			t.Errorf("the relay's sessions: %s = %q (%v), want %q", setting, got, err, want)
		}
	}
}
