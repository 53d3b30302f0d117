package searchindex

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/fanout/fanout/search"
	"github.com/fanout/fanout/shop"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Drift is how an index differs from SQL.
type Drift struct {
	SQLCount, IndexCount int64
	Missing              []int64  // in SQL, not in the index
	Extra                []string // in the index, not in SQL (deleted products)
	Different            []int64  // in both, with different fields or versions
	Sampled              int      // documents compared (0: every document)

	// versions holds, for each id in Different that CheckIDs compared, the
	// product's SQL version and its document's version.
	versions map[int64]versionPair
}

type versionPair struct{ sql, index int64 }

// Total is the number of drifted documents (a count mismatch counts once if
// the sample found nothing).
func (d Drift) Total() int {
	n := len(d.Missing) + len(d.Extra) + len(d.Different)
	if n == 0 && d.SQLCount != d.IndexCount {
		n = 1
	}
	return n
}

func (d Drift) String() string {
	scope := "every document"
	if d.Sampled > 0 {
		scope = fmt.Sprintf("a sample of %d documents", d.Sampled)
	}
	return fmt.Sprintf("SQL has %d products, the index %d documents; comparing %s: %d missing %s, %d extra %s, %d different %s",
		d.SQLCount, d.IndexCount, scope, len(d.Missing), head(d.Missing), len(d.Extra), head(d.Extra), len(d.Different), head(d.Different))
}

func head[T any](xs []T) string {
	if len(xs) == 0 {
		return ""
	}
	var parts []string
	for i, x := range xs {
		if i == 10 {
			parts = append(parts, "...")
			break
		}
		parts = append(parts, fmt.Sprint(x))
	}
	return "(" + strings.Join(parts, ", ") + ")"
}

// productPage is how many products the load and a full check read per
// statement.
const productPage = 5000

// Check compares index with SQL. With sample > 0 it compares the counts and
// that many random products; with sample 0, the counts and every document.
func Check(ctx context.Context, c *search.Client, pool *pgxpool.Pool, index string, sample int) (Drift, error) {
	var d Drift
	var err error
	if err = pool.QueryRow(ctx, `SELECT count(*) FROM products`).Scan(&d.SQLCount); err != nil {
		return d, err
	}
	if d.IndexCount, err = c.Count(ctx, index); err != nil {
		return d, err
	}
	if sample > 0 {
		return checkSample(ctx, c, pool, index, sample, d)
	}
	// Every document: the index side in memory (id -> document), the SQL
	// side streamed.
	indexed := make(map[int64]search.Doc, d.IndexCount)
	err = c.Scan(ctx, index, "id", func(doc search.Doc) error {
		id, err := strconv.ParseInt(doc.ID, 10, 64)
		if err != nil {
			d.Extra = append(d.Extra, doc.ID)
			return nil
		}
		indexed[id] = doc
		return nil
	})
	if err != nil {
		return d, err
	}
	// The SQL side in pages of one snapshot: no statement outlives
	// postgres.statement_timeout on a large catalog.
	err = pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		return shop.ProductPages(ctx, tx, productPage, func(page []shop.Product) error {
			for _, p := range page {
				doc, ok := indexed[p.ID]
				delete(indexed, p.ID)
				switch {
				case !ok:
					d.Missing = append(d.Missing, p.ID)
				case !same(doc, p):
					d.Different = append(d.Different, p.ID)
				}
			}
			return nil
		})
	})
	if err != nil {
		return d, err
	}
	for id := range indexed {
		d.Extra = append(d.Extra, strconv.FormatInt(id, 10))
	}
	slices.Sort(d.Extra)
	return d, nil
}

func checkSample(ctx context.Context, c *search.Client, pool *pgxpool.Pool, index string, n int, d Drift) (Drift, error) {
	rows, err := pool.Query(ctx, `SELECT id FROM products ORDER BY random() LIMIT $1`, n)
	if err != nil {
		return d, err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return d, err
	}
	return CheckIDs(ctx, c, pool, index, ids, d)
}

// CheckIDs compares the given products' documents with SQL, adding what
// drifted to d.
func CheckIDs(ctx context.Context, c *search.Client, pool *pgxpool.Pool, index string, ids []int64, d Drift) (Drift, error) {
	d.Sampled = len(ids)
	if len(ids) == 0 {
		return d, nil
	}
	now, err := readBack(ctx, c, pool, index, ids)
	if err != nil {
		return d, err
	}
	for _, id := range ids {
		switch st := now[id]; {
		case !st.inSQL && st.inIndex:
			d.Extra = append(d.Extra, st.doc.ID)
		case st.inSQL && !st.inIndex:
			d.Missing = append(d.Missing, id)
		case st.inSQL && !st.sameDocs:
			d.Different = append(d.Different, id)
			if d.versions == nil {
				d.versions = map[int64]versionPair{}
			}
			d.versions[id] = versionPair{sql: st.product.Version, index: st.doc.Version}
		}
	}
	return d, nil
}

// IDs are the products concerned by the drift.
func (d Drift) IDs() []int64 {
	ids := append(slices.Clone(d.Missing), d.Different...)
	for _, e := range d.Extra {
		if id, err := strconv.ParseInt(e, 10, 64); err == nil {
			ids = append(ids, id)
		}
	}
	return ids
}

// same reports whether a stored document is the product's current one.
func same(doc search.Doc, p shop.Product) bool {
	var got shop.Product
	if err := json.Unmarshal(doc.Source, &got); err != nil {
		return false
	}
	return got == p && doc.Version == p.Version
}
