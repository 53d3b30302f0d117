#!/usr/bin/env bash
# Stop fanout's local OpenSearch started by start.sh. Idempotent.
# SIGTERM (clean node shutdown via the JVM shutdown hook), wait up to
# FANOUT_DEV_OPENSEARCH_STOP_TIMEOUT seconds (default 30), then SIGKILL.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
DATA="${FANOUT_DEV_DATA_DIR:-$REPO/.data}/opensearch"
PIDFILE="$DATA/opensearch.pid"
PORTFILE="$DATA/opensearch.port"
TIMEOUT="${FANOUT_DEV_OPENSEARCH_STOP_TIMEOUT:-30}"
MAIN=fanout.opensearch.Launcher

is_ours() { [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q "$MAIN"; }

pid="$(cat "$PIDFILE" 2>/dev/null || true)"
if [ -z "$pid" ] || ! is_ours "$pid"; then
  rm -f "$PIDFILE" "$PORTFILE"
  echo "opensearch not running (no live pid in $PIDFILE)"
  exit 0
fi

kill -TERM "$pid" 2>/dev/null || true
for _ in $(seq 1 "$((TIMEOUT * 2))"); do
  is_ours "$pid" || { rm -f "$PIDFILE" "$PORTFILE"; echo "opensearch stopped (pid $pid)"; exit 0; }
  sleep 0.5
done
echo "opensearch pid $pid still alive after ${TIMEOUT}s; sending SIGKILL" >&2
kill -KILL "$pid" 2>/dev/null || true
for _ in $(seq 1 20); do is_ours "$pid" || break; sleep 0.5; done
rm -f "$PIDFILE" "$PORTFILE"
echo "opensearch killed (pid $pid)"
