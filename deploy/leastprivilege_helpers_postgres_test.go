package deploy_test

// These tests run the real relay and subscribers under the production
// nats-server configuration (deploy/nats/nats-server.conf) and the database
// roles of deploy/postgres/roles.sql, and show what each role may and may
// not do: every refusal is the server's own (a NATS permissions violation
// naming the subject, SQLSTATE 42501 from PostgreSQL).

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/connect"
	"github.com/fanout/fanout/internal/testenv/repo"
	"github.com/fanout/fanout/schema/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ---------------------------------------------------------------------------
// PostgreSQL roles from deploy/postgres/roles.sql

// rolesLock serializes applications of roles.sql across test processes:
// roles are cluster-wide. Advisory locks are per database, so it is taken
// in the admin database.
const rolesLock = 0x666f726f6c6573

// applyRoles runs roles.sql with psql against dbURL, as a DBA would, with
// env added to psql's environment, and returns what psql printed.
func applyRoles(t *testing.T, dbURL string, env ...string) string {
	t.Helper()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	return applyRolesFile(t, filepath.Join(root, "deploy", "postgres", "roles.sql"), dbURL, env...)
}

// applyRolesFile runs the roles script at path (see applyRoles).
func applyRolesFile(t *testing.T, path, dbURL string, env ...string) string {
	t.Helper()
	var out string
	withRolesLock(t, func(*pgx.Conn) error {
		var err error
		out, err = runRolesFile(path, dbURL, nil, env...)
		return err
	})
	return out
}

// runRolesFile runs the roles script at path with psql and the variables
// vars (-v name=value), for a caller that holds rolesLock.
func runRolesFile(path, dbURL string, vars []string, env ...string) (string, error) {
	psql, err := exec.LookPath("psql")
	if err != nil {
		psql = "/usr/lib/postgresql/15/bin/psql"
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	args := []string{"-X", "-q", "-v", "ON_ERROR_STOP=1"}
	for _, v := range vars {
		args = append(args, "-v", v)
	}
	cmd := exec.CommandContext(ctx, psql, append(args, "-f", path, dbURL)...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FANOUT_PG_") { // a developer's shell must not set passwords here
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("psql -f roles.sql: %w\n%s", err, out)
	}
	return string(out), nil
}

// withRolesLock runs fn holding rolesLock, with a superuser connection to
// the admin database.
func withRolesLock(t *testing.T, fn func(admin *pgx.Conn) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, err := pgx.Connect(ctx, pgtest.AdminURL())
	if err != nil {
		t.Fatalf("postgres not reachable (start it with deploy/services.sh up): %v", err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(rolesLock)); err != nil {
		t.Fatal(err)
	}
	defer admin.Exec(context.Background(), "SELECT pg_advisory_unlock($1)", int64(rolesLock)) //nolint:errcheck
	if err := fn(admin); err != nil {
		t.Fatal(err)
	}
}

// roleURL is dbURL with role as the user (trust authentication on loopback
// in the development cluster: no password).
func roleURL(t *testing.T, dbURL, role string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return u.String()
}

// rolePool connects to dbURL as role through the production code path.
func rolePool(t *testing.T, cfg *settings, dbURL, role string, opts ...connect.PostgresOption) *pgxpool.Pool {
	t.Helper()
	pc := cfg.Postgres
	pc.URL = roleURL(t, dbURL, role)
	pool, err := connect.Postgres(context.Background(), pc, role, opts...)
	if err != nil {
		t.Fatalf("connect as %s: %v", role, err)
	}
	t.Cleanup(pool.Close)
	var user string
	if err := pool.QueryRow(context.Background(), "SELECT current_user").Scan(&user); err != nil || user != role {
		t.Fatalf("connected as %q (%v), want %s", user, err, role)
	}
	return pool
}

// querier runs statements: a pool, a connection or a transaction.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// denied runs sql, which must fail with SQLSTATE 42501
// (insufficient_privilege).
func denied(t *testing.T, q querier, who, sql string, args ...any) {
	t.Helper()
	_, err := q.Exec(context.Background(), sql, args...)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
		t.Errorf("%s: %s: got %v, want SQLSTATE 42501 (insufficient_privilege)", who, sql, err)
		return
	}
	t.Logf("refused: %-18s %s", who, strings.Join(strings.Fields(sql), " "))
}

// asRole runs fn in a transaction of the superuser pool switched to role
// (SET LOCAL ROLE), as an application role that is a member of role would,
// and rolls it back.
func asRole(t *testing.T, pool *pgxpool.Pool, role string, fn func(tx pgx.Tx)) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if _, err := tx.Exec(ctx, "SET LOCAL ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	fn(tx)
}
