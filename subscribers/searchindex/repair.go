package searchindex

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/shop"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrNotRepaired says a repair left documents that still differ from SQL.
var ErrNotRepaired = errors.New("documents could not be repaired")

// Unrepaired is a drifted document a repair could not fix, and why.
type Unrepaired struct {
	ID     string
	Reason string
}

// RepairReport says what a repair did.
type RepairReport struct {
	// Drifted is how many documents the drift named.
	Drifted int
	// Fixed is how many of them now equal SQL (or have the repair's state
	// or a newer one: see Repair).
	Fixed int
	// Unrepaired are the others, with the reason for each.
	Unrepaired []Unrepaired
}

func (r RepairReport) String() string {
	s := fmt.Sprintf("repaired %d of %d drifted documents", r.Fixed, r.Drifted)
	if len(r.Unrepaired) > 0 {
		s += fmt.Sprintf("; could not repair %d: %s", len(r.Unrepaired), describe(r.Unrepaired, 10, sayUnrepaired))
	}
	return s
}

func sayUnrepaired(u Unrepaired) string { return "document " + u.ID + ": " + u.Reason }

// repairRounds bounds how often Repair writes a document that still
// differs after its write: SQL may have changed in between.
const repairRounds = 3

// Repair writes the current SQL state of every drifted document into index,
// then reads each one back (a realtime get, no refresh needed) and reports
// which it fixed and which it could not, and why. It returns ErrNotRepaired
// (wrapped, with the first reasons) when any could not be fixed.
//
// The repair writes with version_type external_gte, not the indexer's
// external: a document that differs from SQL at the very version SQL has
// (written behind fanout's back, or by a change that did not bump
// products.version) is refused by an external write of that version with a
// 409, which the indexer rightly counts as done, and would stay wrong for
// good. external_gte replaces it. That is safe while indexers run: one
// version of a product has one SQL state, so the state it writes over at
// the same version is either the same or wrong; an older version still
// cannot replace a newer one, and a deletion (DeletedVersion) stays above
// anything.
//
// What no versioned write can fix is reported, not claimed: a document
// whose version is above SQL's (or a deletion the engine remembers with a
// higher version: it forgets it after index.gc_deletes), a document the
// mapping rejects, an engine that keeps failing. A document still behind
// SQL after the repair wrote it, but at or past the version the repair
// wrote, counts as fixed: the change that overtook it was committed after
// the repair read SQL and has an event of its own for the indexer.
func Repair(ctx context.Context, c *search.Client, pool *pgxpool.Pool, index string, bulkSize int, d Drift) (RepairReport, error) {
	rep := RepairReport{Drifted: d.Total()}
	s := syncer{client: c, pool: pool, bulkSize: bulkSize, logger: slog.New(slog.DiscardHandler),
		retryWaits: []time.Duration{200 * time.Millisecond, time.Second}, versionType: search.ExternalGTE}

	pending := d.IDs()
	named := len(pending)
	for round := 1; round <= repairRounds && len(pending) > 0; round++ {
		outcomes, err := s.sync(ctx, index, pending)
		if err != nil {
			return rep, fmt.Errorf("repair %d documents of %s: %w", len(pending), index, err)
		}
		now, err := readBack(ctx, c, pool, index, pending)
		if err != nil {
			return rep, fmt.Errorf("read back %d repaired documents of %s: %w", len(pending), index, err)
		}
		var again []int64
		for _, id := range pending {
			o, st := outcomes[id], now[id]
			if st.fixed(o) {
				rep.Fixed++
				continue
			}
			reason, hopeless := st.why(o)
			if hopeless || round == repairRounds {
				rep.Unrepaired = append(rep.Unrepaired, Unrepaired{ID: strconv.FormatInt(id, 10), Reason: reason})
				continue
			}
			again = append(again, id)
		}
		pending = again
	}

	// Documents whose id is not a product id at all: no product, no version
	// to delete them with.
	var strays []search.Op
	for _, e := range d.Extra {
		if _, err := strconv.ParseInt(e, 10, 64); err != nil {
			strays = append(strays, search.Op{ID: e, Delete: true})
		}
	}
	named += len(strays)
	if len(strays) > 0 {
		results, err := c.Bulk(ctx, index, strays)
		if err != nil {
			return rep, fmt.Errorf("delete %d stray documents of %s: %w", len(strays), index, err)
		}
		for _, r := range results {
			if r.Status < 300 || r.AlreadyDeleted() {
				rep.Fixed++
			} else {
				rep.Unrepaired = append(rep.Unrepaired, Unrepaired{ID: r.ID, Reason: fmt.Sprintf("delete answered %d %s: %s", r.Status, r.Type, r.Reason)})
			}
		}
	}
	if named < rep.Drifted {
		// A count mismatch with no document named (a sampled check): there
		// is nothing to write.
		rep.Unrepaired = append(rep.Unrepaired, Unrepaired{ID: "-", Reason: fmt.Sprintf(
			"SQL has %d products and the index %d documents, but the check named no document: run a full check (no sample)", d.SQLCount, d.IndexCount)})
	}
	slices.SortFunc(rep.Unrepaired, func(a, b Unrepaired) int { return compareIDs(a.ID, b.ID) })
	if len(rep.Unrepaired) > 0 {
		return rep, fmt.Errorf("%w: %d of %d drifted documents in %s still differ from SQL: %s",
			ErrNotRepaired, len(rep.Unrepaired), rep.Drifted, index, describe(rep.Unrepaired, 10, sayUnrepaired))
	}
	return rep, nil
}

// compareIDs orders numeric ids numerically, before any other.
func compareIDs(a, b string) int {
	x, errA := strconv.ParseInt(a, 10, 64)
	y, errB := strconv.ParseInt(b, 10, 64)
	switch {
	case errA == nil && errB == nil:
		return cmp.Compare(x, y)
	case errA == nil:
		return -1
	case errB == nil:
		return 1
	}
	return strings.Compare(a, b)
}

// docState is a product's SQL state and its document, read together (by a
// check, or after a repair wrote it).
type docState struct {
	product  shop.Product
	inSQL    bool
	doc      search.Doc
	inIndex  bool
	sameDocs bool // the document equals the product, version included
}

// readBack reads the products from SQL and their documents from the index
// (a realtime get: what was written, refreshed or not).
func readBack(ctx context.Context, c *search.Client, pool *pgxpool.Pool, index string, ids []int64) (map[int64]docState, error) {
	products, err := shop.LoadProducts(ctx, pool, ids)
	if err != nil {
		return nil, err
	}
	strIDs := make([]string, len(ids))
	for i, id := range ids {
		strIDs[i] = strconv.FormatInt(id, 10)
	}
	docs, err := c.MGet(ctx, index, strIDs)
	if err != nil {
		return nil, err
	}
	out := make(map[int64]docState, len(ids))
	for i, id := range ids {
		st := docState{}
		st.product, st.inSQL = products[id]
		st.doc, st.inIndex = docs[strIDs[i]]
		st.sameDocs = st.inSQL && st.inIndex && same(st.doc, st.product)
		out[id] = st
	}
	return out, nil
}

// fixed reports whether the document is repaired: it equals SQL (or is
// absent, like the product), or it holds the version the repair wrote or a
// newer one that SQL has since overtaken (a change committed after the
// repair read SQL, which its own event brings).
func (st docState) fixed(o docOutcome) bool {
	switch {
	case !st.inSQL:
		return !st.inIndex
	case st.sameDocs:
		return true
	}
	// Written (or refused as older than what the index has: a 409) and
	// overtaken since.
	return o.err() == nil && !o.result.Delete && st.inIndex &&
		o.version <= st.doc.Version && st.doc.Version < st.product.Version
}

// why says why the document still differs, and whether writing it again
// could help.
func (st docState) why(o docOutcome) (reason string, hopeless bool) {
	if o.permanent != nil {
		return o.permanent.Error(), true
	}
	if o.transient != nil {
		return o.transient.Error(), false
	}
	if o.result.Status == http.StatusConflict {
		engine := fmt.Sprintf("the engine answered 409 %s: %s", o.result.Type, o.result.Reason)
		switch {
		case st.inSQL && st.inIndex && st.doc.Version > st.product.Version:
			return fmt.Sprintf("the index holds version %d, above SQL's %d, and no versioned write can lower it (%s); "+
				"`fanout reindex` builds an index without it", st.doc.Version, st.product.Version, engine), true
		case st.inSQL && !st.inIndex:
			return fmt.Sprintf("the index remembers a deletion with a version above SQL's %d (%s); "+
				"it forgets it after index.gc_deletes, then repair again, or run `fanout reindex`", st.product.Version, engine), true
		case !st.inSQL && st.inIndex:
			return fmt.Sprintf("the product is deleted, but the index holds version %d, above the deletion's (%s)", st.doc.Version, engine), true
		}
		return engine, false
	}
	switch {
	case !st.inSQL:
		return fmt.Sprintf("the product is deleted, and the index still has it (version %d)", st.doc.Version), false
	case !st.inIndex:
		return fmt.Sprintf("the index has no document after the repair wrote version %d", o.version), false
	}
	return fmt.Sprintf("the index has version %d, SQL %d, and they differ after the repair wrote version %d", st.doc.Version, st.product.Version, o.version), false
}
