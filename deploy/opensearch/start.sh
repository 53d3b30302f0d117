#!/usr/bin/env bash
# Start fanout's local single-node OpenSearch (real engine, from Maven Central jars).
# Waits until the cluster is green (yellow accepted: all primaries active), at most
# FANOUT_DEV_OPENSEARCH_START_TIMEOUT seconds.
# Idempotent: if a healthy cluster already answers on 127.0.0.1:$PORT it only says so.
# With --build-only it only resolves the jars and compiles the launcher (the
# slow part of a first start: deploy/services.sh runs it beside the other
# installs) and starts nothing.
#
# Env: FANOUT_DEV_OPENSEARCH_PORT           HTTP port (default 9200; transport = port+100)
#      FANOUT_DEV_OPENSEARCH_HEAP           max heap (default 1g; -Xms is 512m)
#      FANOUT_DEV_OPENSEARCH_START_TIMEOUT  seconds to wait for green (default 180)
#      FANOUT_DEV_OPENSEARCH_JAVA           java binary (default: java on PATH, must be 11..21; 17 tested)
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PORT="${FANOUT_DEV_OPENSEARCH_PORT:-9200}"
HEAP="${FANOUT_DEV_OPENSEARCH_HEAP:-1g}"
TIMEOUT="${FANOUT_DEV_OPENSEARCH_START_TIMEOUT:-180}"
JAVA="${FANOUT_DEV_OPENSEARCH_JAVA:-java}"
DATA="${FANOUT_DEV_DATA_DIR:-$REPO/.data}/opensearch"
LOG="$DATA/opensearch.log"
PIDFILE="$DATA/opensearch.pid"
PORTFILE="$DATA/opensearch.port"
URL="http://127.0.0.1:$PORT"
MAIN=fanout.opensearch.Launcher

health() { # prints cluster health JSON if green/yellow, fails otherwise
  local body
  body="$(curl -fsS --max-time 5 "$URL/_cluster/health?wait_for_status=${1:-yellow}&timeout=${2:-1s}" 2>/dev/null)" || return 1
  case "$body" in *'"status":"green"'*|*'"status":"yellow"'*) printf '%s\n' "$body" ;; *) return 1 ;; esac
}
version() { curl -fsS --max-time 5 "$URL/" 2>/dev/null | sed -n 's/.*"number" *: *"\([^"]*\)".*/\1/p' | head -1; }
is_ours() { [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q "$MAIN"; }
status_of() { printf '%s\n' "$1" | sed -n 's/.*"status":"\([a-z]*\)".*/\1/p'; }

# build resolves the jars (the first run downloads ~95 from Maven Central;
# later runs are skipped or offline) and compiles the launcher.
build() {
  cd "$HERE"
  CP_FILE="$HERE/target/classpath.txt"
  fresh=1
  if [ ! -s "$CP_FILE" ] || [ ! -f "$HERE/target/classes/fanout/opensearch/Launcher.class" ] \
     || [ "$HERE/pom.xml" -nt "$CP_FILE" ] \
     || [ -n "$(find "$HERE/src" -newer "$CP_FILE" -type f 2>/dev/null | head -1)" ]; then
    fresh=0
  else
    IFS=: read -r -a jars < "$CP_FILE" || true  # file has no trailing newline
    for j in "${jars[@]}"; do [ -f "$j" ] || { fresh=0; break; }; done
  fi
  if [ "$fresh" = 0 ]; then
    mvncmd=(mvn -q -B -Dstyle.color=never compile dependency:build-classpath -Dmdep.outputFile="$CP_FILE")
    "${mvncmd[@]}" -o >/dev/null 2>&1 || "${mvncmd[@]}" >&2
  fi
}

if [ "${1:-}" = --build-only ]; then
  build
  exit 0
fi

mkdir -p "$DATA"

if h="$(health)"; then
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  echo "opensearch already running: url=$URL version=$(version) status=$(status_of "$h") pid=${pid:-unknown} log=$LOG"
  exit 0
fi

pid=""
if [ -f "$PIDFILE" ]; then
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  if [ -n "$pid" ] && is_ours "$pid"; then
    oldport="$(cat "$PORTFILE" 2>/dev/null || true)"
    if [ -n "$oldport" ] && [ "$oldport" != "$PORT" ]; then
      echo "error: opensearch pid $pid already runs on this data dir with port $oldport (asked for $PORT); run stop.sh first" >&2
      exit 1
    fi
    echo "opensearch pid $pid is running but not healthy yet; waiting for it" >&2
  else
    rm -f "$PIDFILE" "$PORTFILE"; pid=""
  fi
fi

if [ -z "$pid" ]; then
  if curl -s --max-time 2 -o /dev/null "$URL/" 2>/dev/null; then
    echo "error: something not healthy already answers on $URL; not starting a second node (stop it, or set FANOUT_DEV_OPENSEARCH_PORT)" >&2
    exit 1
  fi

  build

  mkdir -p "$DATA/tmp"
  {
    echo "===== $(date -u +%Y-%m-%dT%H:%M:%SZ) start.sh: starting OpenSearch on $URL (heap $HEAP) ====="
  } >> "$LOG"
  FANOUT_DEV_OPENSEARCH_PORT="$PORT" nohup "$JAVA" \
      -Xms512m -Xmx"$HEAP" \
      -XX:+UseG1GC -XX:+HeapDumpOnOutOfMemoryError -XX:HeapDumpPath="$DATA" \
      -Dfile.encoding=UTF-8 -Djava.awt.headless=true -Dlog4j2.formatMsgNoLookups=true -Dlog4j2.shutdownHookEnabled=false \
      -Djava.io.tmpdir="$DATA/tmp" \
      -cp "$HERE/target/classes:$(cat "$CP_FILE")" \
      "$MAIN" "$DATA" >> "$LOG" 2>&1 < /dev/null &
  pid=$!
  echo "$pid" > "$PIDFILE"
  echo "$PORT" > "$PORTFILE"
  cd "$REPO"
fi

start=$SECONDS
while :; do
  # yellow = every primary shard is active, the node can serve; then give green (replicas) a moment.
  if health yellow 1s >/dev/null; then h="$(health green 10s || health yellow 1s)"; break; fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "error: OpenSearch (pid $pid) exited during startup; last 50 lines of $LOG:" >&2
    tail -n 50 "$LOG" >&2
    rm -f "$PIDFILE" "$PORTFILE"
    exit 1
  fi
  if [ $((SECONDS - start)) -ge "$TIMEOUT" ]; then
    echo "error: OpenSearch (pid $pid) not healthy (yellow/green) on $URL after ${TIMEOUT}s; last 50 lines of $LOG:" >&2
    tail -n 50 "$LOG" >&2
    exit 1
  fi
  sleep 0.25
done

echo "opensearch $(version) started: url=$URL status=$(status_of "$h") pid=$pid log=$LOG data=$DATA (healthy after $((SECONDS - start))s)"
