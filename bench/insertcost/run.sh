#!/usr/bin/env bash
# What each part of the outbox insert costs a writer, server side only:
# pgbench runs the same transaction (a product's price update, then the
# outbox insert) against databases that differ in one part each (the
# numbering trigger, skipped by its WHEN; each of the two unsent
# indexes; the check of the writer's event types, run as a writer role),
# 8 clients, RUNS rounds of SECS seconds, the variants in turn.
# It prints each variant's median tx/s, the range, and the median's share
# of the update alone. The Go writer-cost benchmark (bench:relay -only
# writer) measures what a writer in Go sees.
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/versions.env
pg_bin=/usr/lib/postgresql/${POSTGRES_MAJOR:-15}/bin
admin=postgres://postgres@127.0.0.1:${POSTGRES_PORT:-55432} # deploy/services.sh's server
runs=${RUNS:-3}
secs=${SECS:-10}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
go build -o "$work/fanout" ./cmd/fanout

cat >"$work/update.sql" <<'SQL'
\set id random(1, 1000)
\set price random(1000, 91000)
BEGIN;
UPDATE bench_products SET price = :price::numeric / 100, version = version + 1, updated_at = now() WHERE id = :id;
COMMIT;
SQL
cat >"$work/insert.sql" <<'SQL'
\set id random(1, 1000)
\set price random(1000, 91000)
BEGIN;
UPDATE bench_products SET price = :price::numeric / 100, version = version + 1, updated_at = now() WHERE id = :id;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('product', :id::text, 'product.updated', ('{"product_id":' || :id || ',"price_cents":' || :price || '}')::jsonb);
COMMIT;
SQL

names=(update insert unnumbered no_aggregate_index no_unsent_index bare writer writer_unchecked)
# The writer variants run as a login role that may write product.updated
# (a superuser's session skips the check of the writer's event types).
writer_role=fanout_insertcost_writer
"$pg_bin/psql" -q "$admin/postgres" -c "DO \$\$BEGIN CREATE ROLE $writer_role LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END\$\$" >/dev/null
as_writer="GRANT SELECT, UPDATE ON bench_products TO $writer_role;
GRANT INSERT (aggregate_type, aggregate_id, event_type, payload) ON outbox TO $writer_role;
DELETE FROM outbox_writer_types;
INSERT INTO outbox_writer_types (writer, event_type, reason) VALUES ('$writer_role', 'product.updated', 'bench');"

declare -A change=(
  [update]=""
  [insert]=""
  [unnumbered]="SELECT fanout_outbox_numbering('{product.updated}');"
  [no_aggregate_index]="DROP INDEX outbox_aggregate_unsent_idx;"
  [no_unsent_index]="DROP INDEX outbox_unsent_idx;"
  [bare]="SELECT fanout_outbox_numbering('{product.updated}'); DROP INDEX outbox_aggregate_unsent_idx; DROP INDEX outbox_unsent_idx;"
  [writer]="$as_writer"
  [writer_unchecked]="$as_writer DROP TRIGGER outbox_check_writer ON outbox;"
)
declare -A label=(
  [update]="price update alone"
  [insert]="+ the outbox insert"
  [unnumbered]="+ the insert, its type not numbered (trigger skipped by WHEN)"
  [no_aggregate_index]="+ the insert, without outbox_aggregate_unsent_idx"
  [no_unsent_index]="+ the insert, without outbox_unsent_idx"
  [bare]="+ the insert, neither numbered nor either unsent index"
  [writer]="+ the insert as a writer role, its event type checked"
  [writer_unchecked]="+ the insert as a writer role, without the check"
)
for n in "${names[@]}"; do
  db=fanout_insertcost_$n
  "$pg_bin/psql" -q "$admin/postgres" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" 2>/dev/null
  FANOUT_POSTGRES_URL="$admin/$db" "$work/fanout" migrate >"$work/migrate.log" 2>&1 || { cat "$work/migrate.log" >&2; exit 1; }
  "$pg_bin/psql" -q -v ON_ERROR_STOP=1 "$admin/$db" >/dev/null <<SQL
CREATE TABLE bench_products (id bigint PRIMARY KEY, price numeric NOT NULL, version int NOT NULL DEFAULT 1,
    updated_at timestamptz NOT NULL DEFAULT now()) WITH (fillfactor = 70);
INSERT INTO bench_products (id, price) SELECT g, 10 FROM generate_series(1, 1000) g;
${change[$n]}
SQL
done

echo "outbox insert cost, server side: pgbench, 8 clients, $runs rounds of ${secs}s, $(date -u +%FT%TZ)"
declare -A got
for round in $(seq "$runs"); do
  for n in "${names[@]}"; do
    db=fanout_insertcost_$n
    script=$work/insert.sql
    [ "$n" = update ] && script=$work/update.sql
    "$pg_bin/psql" -q "$admin/$db" -c "TRUNCATE outbox, outbox_aggregates" -c "VACUUM bench_products" -c "CHECKPOINT" >/dev/null
    url=$admin/$db
    case $n in writer*) url=postgres://$writer_role@127.0.0.1:${POSTGRES_PORT:-55432}/$db ;; esac
    tps=$("$pg_bin/pgbench" -n -c 8 -j 2 -T "$secs" -M prepared -f "$script" "$url" 2>&1 | sed -n 's/^tps = \([0-9.]*\).*/\1/p')
    [ -n "$tps" ] || { echo "pgbench gave no figure for $n" >&2; exit 1; }
    got[$n]="${got[$n]:-} $tps"
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base=$(echo "${got[update]}" | median)
for n in "${names[@]}"; do
  sorted=$(echo "${got[$n]}" | tr ' ' '\n' | grep . | sort -g)
  med=$(echo "${got[$n]}" | median)
  printf '    %-62s %6.0f tx/s (%d runs: %.0f–%.0f), %3.0f%% of the update alone\n' "${label[$n]}" "$med" "$runs" \
    "$(echo "$sorted" | head -1)" "$(echo "$sorted" | tail -1)" "$(awk -v m="$med" -v b="$base" 'BEGIN {print 100 * m / b}')"
done
for n in "${names[@]}"; do
  "$pg_bin/psql" -q "$admin/postgres" -c "DROP DATABASE IF EXISTS fanout_insertcost_$n" 2>/dev/null
done
