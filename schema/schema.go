package schema

import (
	"bufio"
	"bytes"
	"context"
	"embed"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// ProductIndex is the search index definition (settings and mapping) of the
// product documents: keyword fields for sku, brand and category, text with
// an accent-folding analyzer for name and description, numeric fields, and
// index.gc_deletes long enough that a delete outlives any in-flight stale
// write (see package searchindex). "dynamic": "strict" makes a document with
// an unknown field a mapping error rather than a silent new field.
//
//go:embed search/products.json
var ProductIndex []byte

// Migrations returns the embedded migration files, named NNNNN_what.sql.
func Migrations() fs.FS {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		panic(err) // the embed pattern above guarantees the directory
	}
	return sub
}

// versionTable is where goose records applied migrations.
const versionTable = "fanout_schema_version"

// Migrate applies every pending migration, holding an advisory lock so that
// concurrent callers apply each migration once. It returns the names of the
// migrations it applied (none when the schema is current).
func Migrate(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) ([]string, error) {
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()

	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return nil, fmt.Errorf("create migration lock: %w", err)
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, Migrations(),
		goose.WithSessionLocker(locker),
		goose.WithTableName(versionTable),
		goose.WithDisableGlobalRegistry(true),
	)
	if err != nil {
		return nil, fmt.Errorf("load migrations: %w", err)
	}
	results, err := provider.Up(ctx)
	if err != nil {
		return nil, fmt.Errorf("apply migrations: %w", err)
	}
	applied := make([]string, 0, len(results))
	for _, r := range results {
		applied = append(applied, r.Source.Path)
		logger.Info("migration applied", "migration", r.Source.Path, "duration", r.Duration)
	}
	return applied, nil
}

// Print writes the "up" half of every migration, in order, as plain SQL for
// teams that apply migrations with their own tool.
func Print(w io.Writer) error {
	entries, err := fs.ReadDir(Migrations(), ".")
	if err != nil {
		return err
	}
	for _, e := range entries {
		body, err := fs.ReadFile(Migrations(), e.Name())
		if err != nil {
			return err
		}
		up, err := upSection(body)
		if err != nil {
			return fmt.Errorf("%s: %w", e.Name(), err)
		}
		if _, err := fmt.Fprintf(w, "-- fanout migration %s\n%s\n", e.Name(), up); err != nil {
			return err
		}
	}
	return nil
}

// upSection returns the lines between the goose Up and Down annotations.
func upSection(body []byte) (string, error) {
	var b strings.Builder
	inUp, sawUp := false, false
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		line := sc.Text()
		switch strings.TrimSpace(line) {
		case "-- +goose Up":
			inUp, sawUp = true, true
			continue
		case "-- +goose Down":
			inUp = false
			continue
		case "-- +goose StatementBegin", "-- +goose StatementEnd":
			continue
		}
		if inUp {
			b.WriteString(line)
			b.WriteByte('\n')
		}
	}
	if !sawUp {
		return "", fmt.Errorf("no -- +goose Up section")
	}
	return strings.TrimSpace(b.String()) + "\n", sc.Err()
}
