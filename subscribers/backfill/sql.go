package backfill

import (
	"fmt"
	"strings"

	"github.com/fanout/fanout/subscribers"
)

// The backfill's queries of the table its declaration names (the
// bookkeeping of its progress is the bookkeeping store's). The table, key
// and expressions come from the declaration (checked by its Validate),
// the condition from --where: both run in a read-only transaction.

// chunkSQL reads one chunk of a segment: the rows after a key ($1), up to
// the segment's last key ($2), at most $3 of them, in key order.
func chunkSQL(b *subscribers.Backfill, where string) string {
	id := b.AggregateID
	if strings.TrimSpace(id) == "" {
		id = "t." + b.Key + "::text"
	}
	return fmt.Sprintf(`SELECT t.%[2]s, (%[3]s)::text, (%[4]s)::jsonb FROM %[1]s AS t
WHERE t.%[2]s > $1 AND t.%[2]s <= $2 AND (%[5]s)
ORDER BY t.%[2]s LIMIT $3`, b.Table, b.Key, id, b.Payload, whereOrTrue(where))
}

// boundsSQL reads the backfill's least and greatest keys and how many rows
// it has to do.
func boundsSQL(b *subscribers.Backfill, where string) string {
	return fmt.Sprintf(`WITH high AS (SELECT coalesce(min(%[2]s), 0) AS lo, coalesce(max(%[2]s), 0) AS hi FROM %[1]s)
SELECT high.lo, high.hi, (SELECT count(*) FROM %[1]s AS t WHERE t.%[2]s <= high.hi AND (%[3]s)) FROM high`, b.Table, b.Key, whereOrTrue(where))
}

func whereOrTrue(where string) string {
	if strings.TrimSpace(where) == "" {
		return "true"
	}
	return where
}
