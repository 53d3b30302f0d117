package main

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestFiguresOfEachFormat reads outputs captured from the benchmark
// programs at 9fd5ac2 (2026-12-03), a7e18de and ba07c62 (2026-12-06),
// -runs 1 as bench:compare runs them, and one -runs 2 (a range after each
// median).
// Each must give exactly the figures listed: one missing is a pattern that
// no longer matches, one extra a pattern that matches what it should not.
func TestFiguresOfEachFormat(t *testing.T) {
	cases := []struct {
		file    string
		figures []figurePattern
		want    map[string]float64
	}{
		{"relay-9fd5ac2-a.txt", relayFigures, map[string]float64{
			"(a) poll drain": 21637, "(a) mean claim time": 67.6,
		}},
		{"relay-9fd5ac2-w.txt", relayFigures, map[string]float64{"(w) wal drain": 33174}},
		{"relay-ffc989c-accounts.txt", relayFigures, map[string]float64{
			"(accounts) drain through the import": 31692, "(accounts) drain in the stream's account": 34524,
			"(accounts) drain, import/account":          0.92,
			"(accounts) raw publish through the import": 47008, "(accounts) raw publish in the account": 115693,
		}},
		{"relay-9fd5ac2-latency.txt", relayFigures, map[string]float64{
			"latency fanout default: p50": 5.48, "latency fanout default: p99": 70.44,
			"latency relay.listen=false: p50": 2.89, "latency relay.listen=false: p99": 136.09,
			"latency relay.capture=wal: p50": 21.19, "latency relay.capture=wal: p99": 254.67,
		}},
		{"relay-a7e18de-awcmf.txt", relayFigures, map[string]float64{
			"(a) poll drain": 11997, "(a) mean claim time": 67.8,
			"(a) CPU a row: this process": 14.5, "(a) CPU a row: nats-server": 23.0, "(a) CPU a row: Postgres": 46.0,
			"(w) wal drain":               23670,
			"(w) CPU a row: this process": 25.0, "(w) CPU a row: nats-server": 14.5, "(w) CPU a row: Postgres": 15.0,
			"(c) raw publish":             88665,
			"(c) CPU a row: this process": 4.0, "(c) CPU a row: nats-server": 9.5, "(c) CPU a row: Postgres": 0.5,
			"(m) raw publish of the relay's messages": 71281,
			"(m) CPU a row: this process":             7.5, "(m) CPU a row: nats-server": 11.0, "(m) CPU a row: Postgres": 0.0,
			"(f) fast-ingest batch":       83620,
			"(f) CPU a row: this process": 7.0, "(f) CPU a row: nats-server": 11.0, "(f) CPU a row: Postgres": 0.0,
			"ceilings: a/c": 0.14, "ceilings: w/c": 0.27,
		}},
		{"relay-a7e18de-a-runs2.txt", relayFigures, map[string]float64{
			"(a) poll drain": 16435, "(a) mean claim time": 73.5,
			"(a) CPU a row: this process": 12.0, "(a) CPU a row: nats-server": 17.8, "(a) CPU a row: Postgres": 40.8,
		}},
		{"relay-a7e18de-latency.txt", relayFigures, map[string]float64{
			"latency fanout default: p50": 2.97, "latency fanout default: p99": 19.23,
			"latency relay.listen=false: p50": 2.88, "latency relay.listen=false: p99": 97.92,
			"latency relay.capture=wal: p50": 4.62, "latency relay.capture=wal: p99": 87.33,
		}},
		{"relay-a7e18de-writer.txt", relayFigures, map[string]float64{
			"writer: price update alone":                                                                   4100,
			"writer: + outbox.Write in its own round trip, no wake-up":                                     1871,
			"writer: + outbox.Write in its own round trip, no wake-up, of alone":                           46,
			"writer: + outbox.Queue pipelined with the update, NOTIFY in every tx":                         974,
			"writer: + outbox.Queue pipelined with the update, NOTIFY in every tx, of alone":               24,
			"writer: + outbox.Queue pipelined, no wake-up":                                                 2241,
			"writer: + outbox.Queue pipelined, no wake-up, of alone":                                       55,
			"writer: + outbox.Queue pipelined, no wake-up, its event type not numbered":                    2417,
			"writer: + outbox.Queue pipelined, no wake-up, its event type not numbered, of alone":          59,
			"writer: shop.UpdatePrice: outbox.Queue + fanout wake-up (NOTIFY at most every 2ms)":           2170,
			"writer: shop.UpdatePrice: outbox.Queue + fanout wake-up (NOTIFY at most every 2ms), of alone": 53,
			"writer: shop.UpdatePrice, with a relay (capture poll) publishing":                             1500,
			"writer: shop.UpdatePrice, with a relay (capture poll) publishing, of alone":                   37,
			"writer: outbox.Queue pipelined, no wake-up, with a relay (capture wal) publishing":            1181,
			"writer: outbox.Queue pipelined, no wake-up, with a relay (capture wal) publishing, of alone":  29,
		}},
		{"relay-a7e18de-audit.txt", relayFigures, map[string]float64{
			"(audit) drain, poll, auditor off": 23063, "(audit) drain, poll, auditor off, against off": 1.000,
			"(audit) drain, poll, auditor on (defaults)": 23224, "(audit) drain, poll, auditor on (defaults), against off": 1.007,
			"(audit) drain, poll, auditor on, no delay": 18615, "(audit) drain, poll, auditor on, no delay, against off": 0.807,
			"(audit) drain, wal, auditor off": 30862, "(audit) drain, wal, auditor off, against off": 1.000,
			"(audit) drain, wal, auditor on (defaults)": 31264, "(audit) drain, wal, auditor on (defaults), against off": 1.013,
			"(audit) drain, wal, auditor on, no delay": 23200, "(audit) drain, wal, auditor on, no delay, against off": 0.752,
			"(audit) full audit": 0.2,
		}},
		{"subscribers-9fd5ac2.txt", subscriberFigures, map[string]float64{
			"invoicing, 1 instance (batched transactions, batch_size 100)":     5590,
			"invoicing, 2 instances (batched transactions, batch_size 100)":    5213,
			"baseline: one transaction + one double ack per event, 1 instance": 489,
			"cache invalidation, 1 instance":                                   4872,
			"invoicing 1 instance / baseline":                                  11.4,
			"invoicing 2 instances / 1 instance":                               0.93,
		}},
		{"subscribers-ba07c62.txt", subscriberFigures, map[string]float64{
			"invoicing, 1 instance (batched transactions, batch_size 100)":     12450,
			"invoicing, 2 instances (batched transactions, batch_size 100)":    12480,
			"baseline: one transaction + one double ack per event, 1 instance": 1585,
			"cache invalidation, 1 instance":                                   15149,
			"invoicing 1 instance / baseline":                                  7.9,
			"invoicing 2 instances / 1 instance":                               1.00,
		}},
		{"ordering-9fd5ac2.txt", orderingFigures, map[string]float64{
			"fulfilment ordered (OrderedTx), 1 instance":                            7515,
			"fulfilment ordered (OrderedTx), 2 instances (one pinned, one standby)": 5505,
			"same handler unordered (Tx), 1 instance":                               5461,
			"same handler unordered (Tx), 2 instances":                              6966,
			"ordered / unordered, 1 instance":                                       1.38,
			"ordered / unordered, 2 instances":                                      0.79,
		}},
		{"ordering-ba07c62.txt", orderingFigures, map[string]float64{
			"fulfilment ordered (OrderedTx), 1 instance":                            4378,
			"fulfilment ordered (OrderedTx), 2 instances (one pinned, one standby)": 5197,
			"same handler unordered (Tx), 1 instance":                               7671,
			"same handler unordered (Tx), 2 instances":                              7412,
			"ordered / unordered, 1 instance":                                       0.57,
			"ordered / unordered, 2 instances":                                      0.70,
		}},
		{"search-9fd5ac2.txt", searchFigures, map[string]float64{
			"bulk load": 22027, "bulk load: loader peak RSS": 47,
			"steady indexing, 1 instance(s)": 12190, "steady indexing, 2 instance(s)": 12645, "steady indexing, 2 instances / 1": 1.04,
			"freshness, commit → searchable: p50": 309, "freshness, commit → searchable: p99": 1355,
			"freshness, stage commit_to_puback: p50": 8.2, "freshness, stage commit_to_puback: p99": 71.4,
			"freshness, stage puback_to_delivered: p50": 3.9, "freshness, stage puback_to_delivered: p99": 61.4,
			"freshness, stage delivered_to_handled: p50": 17.0, "freshness, stage delivered_to_handled: p99": 132.2,
			"freshness, stage handled_to_searchable: p50": 229.9, "freshness, stage handled_to_searchable: p99": 1466.5,
		}},
		{"search-ba07c62.txt", searchFigures, map[string]float64{
			"bulk load": 14646, "bulk load: loader peak RSS": 43,
			"steady indexing, 1 instance(s)": 7890, "steady indexing, 2 instance(s)": 8878, "steady indexing, 2 instances / 1": 1.13,
			"freshness, commit → searchable: p50": 314, "freshness, commit → searchable: p99": 1323,
			"freshness, stage commit_to_puback: p50": 10.7, "freshness, stage commit_to_puback: p99": 245.2,
			"freshness, stage puback_to_delivered: p50": 4.0, "freshness, stage puback_to_delivered: p99": 355.9,
			"freshness, stage delivered_to_handled: p50": 23.8, "freshness, stage delivered_to_handled: p99": 137.2,
			"freshness, stage handled_to_searchable: p50": 240.5, "freshness, stage handled_to_searchable: p99": 1470.7,
		}},
		{"backfill-ba07c62.txt", backfillFigures, map[string]float64{
			"backfill":                         5251,
			"live freshness, no backfill: p50": 53, "live freshness, no backfill: p99": 119,
			"live freshness during the backfill: p50": 79, "live freshness during the backfill: p99": 366,
			"p99 during / p99 quiet": 3.07,
		}},
	}
	for _, c := range cases {
		t.Run(c.file, func(t *testing.T) {
			out, err := os.ReadFile(filepath.Join("testdata", c.file))
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]float64{}
			for _, m := range parseFigures(c.figures, string(out)) {
				got[m.name] = m.value
			}
			for _, name := range slices.Sorted(maps.Keys(c.want)) {
				if v, ok := got[name]; !ok {
					t.Errorf("%q not found", name)
				} else if v != c.want[name] {
					t.Errorf("%q = %v, want %v", name, v, c.want[name])
				}
			}
			for _, name := range slices.Sorted(maps.Keys(got)) {
				if _, ok := c.want[name]; !ok {
					t.Errorf("unexpected figure %q = %v", name, got[name])
				}
			}
		})
	}
}

// TestFiguresOfNovember: the poll drain's line as af72d51 (2026-11-30)
// printed it, before the part names and the claim time.
func TestFiguresOfNovember(t *testing.T) {
	got := parseFigures(relayFigures, "(a) fanout relay drained 200000 rows in 5.80s: 34483 rows/s\n")
	if len(got) != 1 || got[0].name != "(a) poll drain" || got[0].value != 34483 {
		t.Fatalf("got %+v, want the poll drain at 34483 rows/s", got)
	}
}
