#!/usr/bin/env bash
# Smoke-test the node started by start.sh with plain curl: version, index with
# custom analyzer + gc_deletes + refresh toggling, _bulk with external versions
# (incl. a 409), atomic alias swap, searches. Creates and deletes smoke_* indices.
set -euo pipefail
U="http://127.0.0.1:${FANOUT_DEV_OPENSEARCH_PORT:-9200}"
J='Content-Type: application/json'
fail() { echo "SMOKE FAIL: $*" >&2; exit 1; }
req() { curl -sS --max-time 30 -H "$J" "$@"; }
expect() { case "$2" in *"$1"*) ;; *) fail "expected [$1] in: $2";; esac; }

req -XDELETE "$U/smoke_v1,smoke_v2?ignore_unavailable=true" >/dev/null

r="$(req "$U/")"; expect '"distribution" : "opensearch"' "$r"
ver="$(printf '%s' "$r" | sed -n 's/.*"number" *: *"\([^"]*\)".*/\1/p')"

r="$(req -XPUT "$U/smoke_v1" -d '{
 "settings":{"number_of_shards":1,"number_of_replicas":0,"refresh_interval":"-1","index.gc_deletes":"120s",
  "analysis":{"analyzer":{"folded":{"type":"custom","tokenizer":"standard","filter":["lowercase","asciifolding"]}}}},
 "mappings":{"dynamic":"strict","properties":{"sku":{"type":"keyword"},"name":{"type":"text","analyzer":"folded"},
  "desc":{"type":"text","analyzer":"standard"},"price_cents":{"type":"long"},"rating":{"type":"float"}}}}')"
expect '"acknowledged":true' "$r"
r="$(req -XPUT "$U/smoke_v1/_settings" -d '{"index":{"refresh_interval":"1s"}}')"; expect '"acknowledged":true' "$r"
r="$(req "$U/smoke_v1/_settings?flat_settings=true")"
expect '"index.gc_deletes":"120s"' "$r"; expect '"index.refresh_interval":"1s"' "$r"

r="$(curl -sS --max-time 30 -XPOST "$U/_bulk?refresh=wait_for" -H "Content-Type: application/x-ndjson" --data-binary $'{"index":{"_index":"smoke_v1","_id":"p1","version":5,"version_type":"external"}}\n{"sku":"SKU-1","name":"Cr\xc3\xa8me Br\xc3\xbbl\xc3\xa9e Torch","desc":"A kitchen torch","price_cents":2599,"rating":4.5}\n{"index":{"_index":"smoke_v1","_id":"p1","version":4,"version_type":"external"}}\n{"sku":"SKU-1","name":"STALE","desc":"old","price_cents":1,"rating":1}\n{"index":{"_index":"smoke_v1","_id":"p2","version":3,"version_type":"external"}}\n{"sku":"SKU-2","name":"Mug","desc":"mug","price_cents":999,"rating":4.1}\n{"delete":{"_index":"smoke_v1","_id":"p2","version":7,"version_type":"external"}}\n{"index":{"_index":"smoke_v1","_id":"p2","version":6,"version_type":"external"}}\n{"sku":"SKU-2","name":"older than the delete","desc":"x","price_cents":1,"rating":1}\n')"
expect '"errors":true' "$r"
[ "$(printf '%s' "$r" | grep -o '"status":409' | wc -l)" = 2 ] || fail "want two 409s in: $r"
[ "$(printf '%s' "$r" | grep -o '"status":201' | wc -l)" = 2 ] || fail "want two 201s in: $r"

r="$(req -XPUT "$U/smoke_v2" -d '{"settings":{"number_of_shards":1},"mappings":{"properties":{"sku":{"type":"keyword"}}}}')"
expect '"acknowledged":true' "$r"
req -XPUT "$U/smoke_v2/_doc/p9?refresh=true" -d '{"sku":"SKU-9"}' >/dev/null
r="$(req -XPOST "$U/_aliases" -d '{"actions":[{"add":{"index":"smoke_v1","alias":"smoke"}}]}')"; expect '"acknowledged":true' "$r"
r="$(req -XPOST "$U/smoke/_search" -d '{"query":{"match":{"name":"creme brulee"}}}')"; expect '"_id":"p1"' "$r"
r="$(req -XPOST "$U/smoke/_search" -d '{"query":{"bool":{"filter":[{"term":{"sku":"SKU-1"}},{"range":{"price_cents":{"gte":2000}}}]}}}')"
expect '"value":1' "$r"
r="$(req -XPOST "$U/_aliases" -d '{"actions":[{"remove":{"index":"smoke_v1","alias":"smoke"}},{"add":{"index":"smoke_v2","alias":"smoke"}}]}')"
expect '"acknowledged":true' "$r"
r="$(req -XPOST "$U/smoke/_search" -d '{"query":{"match_all":{}}}')"; expect '"_index":"smoke_v2"' "$r"; expect '"value":1' "$r"
r="$(req "$U/_cluster/health")"; expect '"status":"green"' "$r"

req -XDELETE "$U/smoke_v1,smoke_v2" >/dev/null
echo "opensearch smoke: 1 passed, 0 failed (version $ver at $U)"
