// Package pgtest gives each test a database of its own on the real
// PostgreSQL server that deploy/services.sh starts, created from a migrated
// template so it costs a file copy rather than a migration run.
//
// The server is found at FANOUT_TEST_POSTGRES_URL (default
// postgres://postgres@127.0.0.1:55432/postgres). If it does not answer, the
// test fails and says how to start it: a missing service is never a skip.
package pgtest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/fanout/fanout/schema"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultAdminURL is the superuser URL of the development server.
const DefaultAdminURL = "postgres://postgres@127.0.0.1:55432/postgres?sslmode=disable"

// AdminURL is the superuser URL tests use to create databases.
func AdminURL() string {
	if u := os.Getenv("FANOUT_TEST_POSTGRES_URL"); u != "" {
		return u
	}
	return DefaultAdminURL
}

// DB is one test database.
type DB struct {
	Name     string
	URL      string
	Pool     *pgxpool.Pool
	adminURL string
}

// NewDB creates a migrated database for t, and drops it when t ends.
func NewDB(t testing.TB) *DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db, err := Create(ctx, AdminURL())
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(db.Close)
	return db
}

var templateMu sync.Mutex

// Create makes a new migrated database on the server at adminURL.
func Create(ctx context.Context, adminURL string) (*DB, error) {
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return nil, fmt.Errorf("postgres not reachable at %s (start it with deploy/services.sh up): %w", redact(adminURL), err)
	}
	defer admin.Close(context.Background())

	tpl, err := ensureTemplate(ctx, admin, adminURL)
	if err != nil {
		return nil, err
	}
	name := fmt.Sprintf("fanout_test_%d_%08x", time.Now().Unix(), rand.Uint32())
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s", name, tpl)); err != nil {
		return nil, fmt.Errorf("create test database: %w", err)
	}
	dbURL := withDatabase(adminURL, name)
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	return &DB{Name: name, URL: dbURL, Pool: pool, adminURL: adminURL}, nil
}

// Close closes the pool and drops the database.
func (db *DB) Close() {
	db.Pool.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, db.adminURL)
	if err != nil {
		return
	}
	defer admin.Close(context.Background())
	// A database with a replication slot (a wal relay's) cannot be dropped:
	// end the slots' streams and drop them first.
	_, _ = admin.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, db.Name)
	for i := 0; i < 50; i++ {
		_, _ = admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active`, db.Name)
		var remaining int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE database = $1`, db.Name).Scan(&remaining); err != nil || remaining == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	_, _ = admin.Exec(ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", db.Name))
}

// ensureTemplate creates, once per schema version, a database with every
// migration applied. Its name carries a hash of the migrations, so a changed
// migration gets a fresh template. An advisory lock serializes test binaries
// that race to create it.
func ensureTemplate(ctx context.Context, admin *pgx.Conn, adminURL string) (string, error) {
	templateMu.Lock()
	defer templateMu.Unlock()
	name := "fanout_template_" + migrationsHash()[:12]
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock(74726573)"); err != nil {
		return "", err
	}
	defer admin.Exec(context.Background(), "SELECT pg_advisory_unlock(74726573)") //nolint:errcheck
	var exists bool
	if err := admin.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return "", err
	}
	if exists {
		return name, nil
	}
	building := name + "_building"
	_, _ = admin.Exec(ctx, fmt.Sprintf("DROP DATABASE IF EXISTS %s WITH (FORCE)", building))
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+building); err != nil {
		return "", fmt.Errorf("create template database: %w", err)
	}
	pool, err := pgxpool.New(ctx, withDatabase(adminURL, building))
	if err != nil {
		return "", err
	}
	_, err = schema.Migrate(ctx, pool, slog.New(slog.NewTextHandler(io.Discard, nil)))
	pool.Close()
	if err != nil {
		return "", fmt.Errorf("migrate template database: %w", err)
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s RENAME TO %s", building, name)); err != nil {
		return "", err
	}
	return name, nil
}

func migrationsHash() string {
	h := sha256.New()
	_ = fs.WalkDir(schema.Migrations(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, _ := fs.ReadFile(schema.Migrations(), path)
		h.Write([]byte(path))
		h.Write(b)
		return nil
	})
	return hex.EncodeToString(h.Sum(nil))
}

func withDatabase(rawURL, db string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return rawURL
	}
	u.Path = "/" + db
	return u.String()
}

func redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparseable URL)"
	}
	return u.Redacted()
}
