package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fanout/fanout/internal/testenv/porthold"
	"github.com/jackc/pgx/v5"
)

// pgBin is where Debian's postgresql package puts the server binaries.
const pgBin = "/usr/lib/postgresql/15/bin"

// Server is a PostgreSQL server of one test's own, for tests that restart or
// kill it; other tests share the development server through NewDB.
type Server struct {
	AdminURL string
	dir      string
	port     int
	runAs    []string
	// hold keeps a stopped server's port until it starts again.
	hold porthold.Hold
}

// StartServer initializes and starts a server for t and stops it when t
// ends. Initialization takes a couple of seconds.
func StartServer(t testing.TB) *Server {
	t.Helper()
	s, err := startServer()
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(s.stop)
	return s
}

func startServer() (*Server, error) {
	dir, err := os.MkdirTemp("", "fanout-pgtest-")
	if err != nil {
		return nil, err
	}
	s := &Server{dir: dir}
	// PostgreSQL refuses to run as root; run it as the postgres user that
	// the Debian package creates.
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root and no postgres user to run the server as: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			return nil, err
		}
		s.runAs = []string{"runuser", "-u", "postgres", "--"}
	}
	if out, err := s.run(filepath.Join(pgBin, "initdb"), "-D", s.data(), "-U", "postgres", "--auth=trust", "--no-sync"); err != nil {
		return nil, fmt.Errorf("initdb: %v\n%s", err, out)
	}
	// A port found free may be taken before the server binds it (tests in
	// other packages start servers at the same time): pg_ctl then fails,
	// and another port is tried.
	for range 5 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		s.port = l.Addr().(*net.TCPAddr).Port
		l.Close()
		s.AdminURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
		err = s.Start()
		if err == nil {
			return s, nil
		}
		if !strings.Contains(err.Error(), "already in use") {
			return nil, err
		}
		_ = os.Remove(filepath.Join(s.dir, "postgres.log")) // the next try's log alone
	}
	return nil, fmt.Errorf("postgres: no free port after 5 tries")
}

func (s *Server) data() string { return filepath.Join(s.dir, "data") }

func (s *Server) run(name string, args ...string) ([]byte, error) {
	argv := append(append([]string{}, s.runAs...), name)
	argv = append(argv, args...)
	return exec.Command(argv[0], argv[1:]...).CombinedOutput()
}

func (s *Server) pgctl(args ...string) error {
	base := []string{"-D", s.data(), "-l", filepath.Join(s.dir, "postgres.log"), "-w", "-t", "60"}
	out, err := s.run(filepath.Join(pgBin, "pg_ctl"), append(base, args...)...)
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(s.dir, "postgres.log"))
		return fmt.Errorf("pg_ctl %v: %v\n%s\n%s", args, err, out, log)
	}
	return nil
}

func (s *Server) options() string {
	return fmt.Sprintf("-c listen_addresses=127.0.0.1 -p %d -c unix_socket_directories=%s -c fsync=off -c wal_level=logical -c max_replication_slots=20 -c max_wal_senders=20", s.port, s.dir)
}

// Start starts the server (after Stop).
func (s *Server) Start() error {
	s.hold.Release()
	if err := s.pgctl("start", "-o", s.options()); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		conn, err := pgx.Connect(ctx, s.AdminURL)
		if err == nil {
			conn.Close(ctx)
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("postgres on port %d did not answer: %w", s.port, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// RestartImmediate restarts the server the way a crash does: `pg_ctl
// restart -m immediate` aborts every connection without a checkpoint.
func (s *Server) RestartImmediate() error {
	return s.pgctl("restart", "-m", "immediate", "-o", s.options())
}

// SetHBA replaces the server's pg_hba.conf with lines and reloads it. The
// superuser keeps its trusted local and loopback access, first.
func (s *Server) SetHBA(lines string) error {
	hba := "local all postgres trust\nhost all postgres 127.0.0.1/32 trust\n" + lines
	if err := os.WriteFile(filepath.Join(s.data(), "pg_hba.conf"), []byte(hba), 0o644); err != nil {
		return err
	}
	return s.pgctl("reload")
}

// Stop stops the server (fast mode). Its port stays this server's until
// Start (package porthold).
func (s *Server) Stop() error {
	if err := s.pgctl("stop", "-m", "fast"); err != nil {
		return err
	}
	s.hold.Take(s.port)
	return nil
}

func (s *Server) stop() {
	_ = s.pgctl("stop", "-m", "immediate")
	s.hold.Release()
	_ = os.RemoveAll(s.dir)
}

// NewDB creates a migrated database on this server for t.
func (s *Server) NewDB(t testing.TB) *DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db, err := Create(ctx, s.AdminURL)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(db.Close)
	return db
}

// BaseBackup takes a base backup of the running server (pg_basebackup,
// with the WAL it needs) and returns its directory, for RestoreBackup.
func (s *Server) BaseBackup() (string, error) {
	dir := filepath.Join(s.dir, fmt.Sprintf("backup-%d", time.Now().UnixNano()))
	url := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres", s.port)
	if out, err := s.run(filepath.Join(pgBin, "pg_basebackup"), "-d", url, "-D", dir, "-X", "stream", "-c", "fast", "--no-sync"); err != nil {
		return "", fmt.Errorf("pg_basebackup: %v\n%s", err, out)
	}
	return dir, nil
}

// RestoreBackup stops the server as a crash would, puts the base backup in
// place of its data directory, and starts it: the server recovers to the
// backup's point and forgets everything after it, as a restore does.
func (s *Server) RestoreBackup(backup string) error {
	if err := s.pgctl("stop", "-m", "immediate"); err != nil {
		return err
	}
	if err := os.RemoveAll(s.data()); err != nil {
		return err
	}
	// A copy: the backup can be restored again.
	if out, err := s.run("cp", "-a", backup, s.data()); err != nil {
		return fmt.Errorf("copy the backup: %v\n%s", err, out)
	}
	return s.Start()
}
