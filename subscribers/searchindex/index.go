package searchindex

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/fanout/fanout/schema"
	"github.com/fanout/fanout/search"
	"github.com/jackc/pgx/v5/pgxpool"
)

// IndexName is the name of version n of the index behind alias.
func IndexName(alias string, n int) string { return alias + "-v" + strconv.Itoa(n) }

// indexVersion parses the N of <alias>-vN, or returns 0.
func indexVersion(alias, name string) int {
	n, err := strconv.Atoi(strings.TrimPrefix(name, alias+"-v"))
	if err != nil || !strings.HasPrefix(name, alias+"-v") {
		return 0
	}
	return n
}

// Versions lists the existing <alias>-vN indices, oldest first.
func Versions(ctx context.Context, c *search.Client, alias string) ([]string, error) {
	names, err := c.Indices(ctx, alias+"-v*")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, n := range names {
		if indexVersion(alias, n) > 0 {
			out = append(out, n)
		}
	}
	// Numeric order: v10 after v9.
	slices.SortStableFunc(out, func(a, b string) int { return cmp.Compare(indexVersion(alias, a), indexVersion(alias, b)) })
	return out, nil
}

// indices returns the index the alias points at ("" if none) and the
// <alias>-vN indices, oldest first.
func indices(ctx context.Context, c *search.Client, alias string) (current string, versions []string, err error) {
	if current, err = Current(ctx, c, alias); err == nil {
		versions, err = Versions(ctx, c, alias)
	}
	return current, versions, err
}

// Current returns the index the alias points at, or "" if none.
func Current(ctx context.Context, c *search.Client, alias string) (string, error) {
	names, err := c.AliasIndices(ctx, alias)
	if err != nil {
		return "", err
	}
	switch len(names) {
	case 0:
		return "", nil
	case 1:
		return names[0], nil
	}
	return "", fmt.Errorf("alias %s points at %d indices (%v); fanout needs exactly one", alias, len(names), names)
}

// EnsureIndex makes sure the alias points at an index: with provision auto
// it creates <alias>-v1 from the mapping in schema/ if there is none;
// verify refuses to go on without one; off does not look.
func EnsureIndex(ctx context.Context, c *search.Client, alias, provision string) error {
	if provision == "off" {
		return nil
	}
	cur, err := Current(ctx, c, alias)
	if err != nil || cur != "" {
		return err
	}
	if provision == "verify" {
		return fmt.Errorf("alias %s points at no index (search.provision=verify): run `fanout reindex` to build one", alias)
	}
	name := IndexName(alias, 1)
	if err := c.CreateIndex(ctx, name, schema.ProductIndex); err != nil {
		var e *search.Error
		if !(errors.As(err, &e) && e.Type == "resource_already_exists_exception") {
			return fmt.Errorf("create index %s: %w", name, err)
		}
	}
	if err := c.SwapAlias(ctx, alias, name); err != nil {
		return fmt.Errorf("point alias %s at %s: %w", alias, name, err)
	}
	return nil
}

// Rollback points the alias at the newest index older than the current one,
// then repairs that index's drift from SQL (it missed the updates made since
// the swap). It returns the index left, the index now current and what the
// repair did; when some documents could not be repaired, the alias has
// moved all the same and the error wraps ErrNotRepaired.
func Rollback(ctx context.Context, c *search.Client, pool *pgxpool.Pool, cfg Config) (from, to string, repair RepairReport, err error) {
	from, versions, err := indices(ctx, c, cfg.Alias)
	if err != nil {
		return "", "", repair, err
	}
	for _, v := range versions {
		if indexVersion(cfg.Alias, v) < indexVersion(cfg.Alias, from) {
			to = v
		}
	}
	if to == "" {
		return from, "", repair, fmt.Errorf("no index older than %s to roll back to (have %v)", from, versions)
	}
	if err := c.SwapAlias(ctx, cfg.Alias, to); err != nil {
		return from, to, repair, err
	}
	_ = c.Refresh(ctx, to)
	drift, err := Check(ctx, c, pool, to, 0)
	if err != nil {
		return from, to, repair, fmt.Errorf("rolled back to %s, but checking it failed (run `fanout reindex --check --repair`): %w", to, err)
	}
	repair, err = Repair(ctx, c, pool, to, cfg.BulkSize, drift)
	if err != nil {
		return from, to, repair, fmt.Errorf("rolled back to %s, but repairing it failed: %w", to, err)
	}
	return from, to, repair, nil
}

// Cleanup deletes every <alias>-vN index the alias does not point at.
func Cleanup(ctx context.Context, c *search.Client, alias string) ([]string, error) {
	cur, versions, err := indices(ctx, c, alias)
	if err != nil {
		return nil, err
	}
	var deleted []string
	for _, v := range versions {
		if v == cur {
			continue
		}
		if err := c.DeleteIndex(ctx, v); err != nil {
			return deleted, err
		}
		deleted = append(deleted, v)
	}
	return deleted, nil
}
