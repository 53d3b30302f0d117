package deploy_test

// The relay's role in wal capture: roles.sql gives fanout_relay the
// REPLICATION attribute only when run with -v relay_capture=wal, and with
// it (and nothing more) a wal relay creates its slot and streams from it.

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/relay"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/fanout/fanout/stream"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"
)

func TestRelayRoleReplicatesOnlyInWALCapture(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cfg := loadConfig(t)
	db := pgtest.NewDB(t)
	ns := startNATS(t)
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	rolesSQL := filepath.Join(root, "deploy", "postgres", "roles.sql")
	replication := func(admin *pgx.Conn) bool {
		t.Helper()
		var on bool
		if err := admin.QueryRow(ctx, `SELECT rolreplication FROM pg_roles WHERE rolname = 'fanout_relay'`).Scan(&on); err != nil {
			t.Fatal(err)
		}
		return on
	}
	// Roles are cluster-wide: hold the lock while fanout_relay replicates,
	// so that no other test's run of roles.sql takes it away meanwhile.
	withRolesLock(t, func(admin *pgx.Conn) error {
		if out, err := runRolesFile(rolesSQL, db.URL, []string{"relay_capture=sometimes"}); err == nil || !strings.Contains(out, "relay_capture must be poll or wal") {
			t.Errorf("roles.sql with relay_capture=sometimes: %v, output %q; want a refusal naming the variable", err, out)
		}
		if _, err := runRolesFile(rolesSQL, db.URL, nil); err != nil {
			return err
		}
		if replication(admin) {
			t.Error("after roles.sql without relay_capture, fanout_relay has REPLICATION")
		}
		cc, err := pgconn.ParseConfig(roleURL(t, db.URL, "fanout_relay") + "&replication=database")
		if err != nil {
			return err
		}
		if conn, err := pgconn.ConnectConfig(ctx, cc); err == nil {
			conn.Close(ctx)
			t.Error("fanout_relay opened a replication connection without REPLICATION")
		}

		if _, err := runRolesFile(rolesSQL, db.URL, []string{"relay_capture=wal"}); err != nil {
			return err
		}
		if !replication(admin) {
			t.Error("after roles.sql with relay_capture=wal, fanout_relay lacks REPLICATION")
		}
		provJS, err := jetstream.New(natsConn(t, cfg, ns, "provisioner", logger))
		if err != nil {
			return err
		}
		if err := stream.Ensure(ctx, provJS, cfg.Stream, relay.RepublishDelay(cfg.Relay), logger); err != nil {
			return err
		}
		cfg.Stream.Provision = "verify"
		rc := cfg.Relay
		rc.Capture, rc.Slot = relay.CaptureWAL, db.Name
		rl, err := relay.New(relay.Options{Relay: rc, Stream: cfg.Stream, Pool: rolePool(t, cfg, db.URL, "fanout_relay"),
			Conn: natsConn(t, cfg, ns, "relay", logger), Logger: logger})
		if err != nil {
			return err
		}
		if err := rl.Start(ctx); err != nil {
			return err
		}
		defer func() {
			sctx, c := context.WithTimeout(context.Background(), 10*time.Second)
			defer c()
			_ = rl.Stop(sctx)
		}()
		waitFor(t, "the wal relay, as fanout_relay, to create its slot and record its backlog", func() bool {
			var done bool
			err := db.Pool.QueryRow(ctx, `SELECT backlog_done_at IS NOT NULL FROM relay_capture WHERE slot_name = $1`, db.Name).Scan(&done)
			return err == nil && done
		})
		err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := outbox.Write(ctx, tx, orderEvent(1))
			return err
		})
		if err != nil {
			return err
		}
		js, err := jetstream.New(natsConn(t, cfg, ns, "admin", logger))
		if err != nil {
			return err
		}
		waitFor(t, "the event in the stream", func() bool {
			s, err := js.Stream(ctx, cfg.Stream.Name)
			if err != nil {
				return false
			}
			info, err := s.Info(ctx)
			return err == nil && info.State.Msgs == 1
		})

		// Back to poll: the attribute goes again.
		if _, err := runRolesFile(rolesSQL, db.URL, nil); err != nil {
			return err
		}
		if replication(admin) {
			t.Error("after roles.sql without relay_capture again, fanout_relay still has REPLICATION")
		}
		return nil
	})
}

// The pg_hba.conf lines fanout ships keep its roles to its database, and
// fanout_relay, with REPLICATION for wal capture, to logical replication of
// that database: no physical replication (the whole cluster's WAL, base
// backups), no other database. What they cannot take away, and the docs
// say, is shown too: within its database, REPLICATION lets the role read
// every table's changes through a slot of its own with another output
// plugin, although it may SELECT none of them.
func TestWALRoleReachesOnlyItsDatabase(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	srv := pgtest.StartServer(t)
	db := srv.NewDB(t)
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	hba, err := os.ReadFile(filepath.Join(root, "deploy", "postgres", "pg_hba.conf"))
	if err != nil {
		t.Fatal(err)
	}
	lines := regexp.MustCompile(`(?m)^((?:host|local)\s+)fanout(\s)`).ReplaceAllString(string(hba), "${1}"+db.Name+"${2}")
	if err := srv.SetHBA(lines); err != nil {
		t.Fatal(err)
	}
	pw := "p" + randomHex(t, 12)
	if out, err := runRolesFile(filepath.Join(root, "deploy", "postgres", "roles.sql"), db.URL, []string{"relay_capture=wal"}, "FANOUT_PG_RELAY_PASSWORD="+pw); err != nil {
		t.Fatalf("roles.sql: %v\n%s", err, out)
	}
	u, err := url.Parse(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	relayURL := func(database, replication string) string {
		r := *u
		r.User = url.UserPassword("fanout_relay", pw)
		r.Path = "/" + database
		q := r.Query()
		if replication != "" {
			q.Set("replication", replication)
		}
		r.RawQuery = q.Encode()
		return r.String()
	}
	connect := func(database, replication string) (*pgconn.PgConn, error) {
		return pgconn.Connect(ctx, relayURL(database, replication))
	}

	// Its database, as a relay connects: allowed, and no table but the
	// outbox's to read.
	conn, err := connect(db.Name, "")
	if err != nil {
		t.Fatalf("fanout_relay connects to its database: %v", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SELECT count(*) FROM orders`).ReadAll(); err == nil || !strings.Contains(err.Error(), "42501") {
		t.Errorf("fanout_relay reads orders: %v; want permission denied", err)
	}
	// Logical replication of its database, as a wal relay streams: allowed.
	repl, err := connect(db.Name, "database")
	if err != nil {
		t.Fatalf("fanout_relay opens a logical replication connection to its database: %v", err)
	}
	if _, err := repl.Exec(ctx, "IDENTIFY_SYSTEM").ReadAll(); err != nil {
		t.Errorf("IDENTIFY_SYSTEM: %v", err)
	}
	repl.Close(ctx)
	// Refused by pg_hba: physical replication, and any other database.
	for _, c := range []struct{ what, database, replication string }{
		{"a physical replication connection (the cluster's WAL, base backups)", db.Name, "true"},
		{"another database", "postgres", ""},
		{"logical replication of another database", "postgres", "database"},
	} {
		if pc, err := connect(c.database, c.replication); err == nil {
			pc.Close(ctx)
			t.Errorf("fanout_relay opened %s", c.what)
		} else if !strings.Contains(err.Error(), "pg_hba.conf rejects") {
			t.Errorf("fanout_relay, %s: %v; want pg_hba.conf's refusal", c.what, err)
		} else {
			t.Logf("refused: fanout_relay, %s: %v", c.what, err)
		}
	}

	// What REPLICATION still allows in its own database.
	slot := "snoop_" + randomHex(t, 4)
	if _, err := conn.Exec(ctx, fmt.Sprintf(`SELECT pg_create_logical_replication_slot('%s', 'test_decoding')`, slot)).ReadAll(); err != nil {
		t.Fatalf("fanout_relay creates a test_decoding slot: %v (if the server refuses it now, docs/security.md and pg_hba.conf's comment overstate the risk)", err)
	}
	defer func() { _, _ = db.Pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, slot) }()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO orders (customer) VALUES ('Ada Secret')`); err != nil {
		t.Fatal(err)
	}
	res, err := conn.Exec(ctx, fmt.Sprintf(`SELECT string_agg(data, E'\n') FROM pg_logical_slot_get_changes('%s', NULL, NULL)`, slot)).ReadAll()
	if err != nil || len(res) == 0 || len(res[0].Rows) == 0 || !strings.Contains(string(res[0].Rows[0][0]), "Ada Secret") {
		t.Errorf("fanout_relay reading orders' changes through its own slot: %v; the documented risk no longer holds", err)
	} else {
		t.Logf("allowed (documented): fanout_relay reads the changes of a table it may not SELECT, through a test_decoding slot: %.120s", res[0].Rows[0][0])
	}
}
