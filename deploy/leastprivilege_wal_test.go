package deploy_test

// The relay's role in wal capture: roles.sql gives fanout_relay the
// REPLICATION attribute only when run with -v relay_capture=wal, and with
// it (and nothing more) a wal relay creates its slot and streams from it.

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/pgtest"
	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/outbox"
	"github.com/fanout/fanout/relay"
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
