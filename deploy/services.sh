#!/usr/bin/env bash
# Installs (pinned) and starts the local services fanout needs, on 127.0.0.1:
# PostgreSQL and Redis from Debian packages, nats-server and the nats CLI via
# `go install`, and OpenSearch from Maven Central (deploy/opensearch).
#
#   deploy/services.sh up      install what is missing, start what is down, wait
#   deploy/services.sh down    stop everything this script started
#   deploy/services.sh status  say what answers where
#   deploy/services.sh nats-cli build the nats CLI into .bin/ (for people and the docs test)
#
# Idempotent: a service that already answers is left alone. Data lives under
# .data/ in the repository (override with FANOUT_DEV_DATA_DIR).
# FANOUT_DEV_SKIP_SEARCH=1 skips OpenSearch. FANOUT_DEV_NATS_CLI says what
# becomes of the nats CLI: wait (the default: built before `up` returns),
# background (built without waiting, what `go tool task up` and `go tool
# task test` do: no service needs it, and the docs test waits for it) or skip.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=deploy/versions.env
source "$repo/deploy/versions.env"
data=${FANOUT_DEV_DATA_DIR:-$repo/.data}
bin=$repo/.bin
pg_bin=/usr/lib/postgresql/$POSTGRES_MAJOR/bin

log() { printf '[services %3ds] %s\n' "$SECONDS" "$*"; }
die() { printf '[services] error: %s\n' "$*" >&2; exit 1; }

# wait_for NAME SECONDS CMD...: run CMD until it succeeds or time runs out.
wait_for() {
  local name=$1 secs=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "$name did not answer within ${secs}s"
    sleep 0.2
  done
}

apt_install() {
  # apt_install PKG=VERSION...: install exactly these versions if missing.
  local missing=()
  for spec in "$@"; do
    local pkg=${spec%%=*} want=${spec#*=} have
    have=$(dpkg-query -W -f='${Status} ${Version}' "$pkg" 2>/dev/null || true)
    if [[ $have != "install ok installed $want" ]]; then missing+=("$spec"); fi
  done
  ((${#missing[@]} == 0)) && return 0
  log "installing ${missing[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q --allow-downgrades "${missing[@]}" >"$data/apt.log" 2>&1; then
    apt-get update -q >>"$data/apt.log" 2>&1 || true
    apt-get install -y -q --allow-downgrades "${missing[@]}" >>"$data/apt.log" 2>&1 ||
      { tail -20 "$data/apt.log" >&2; die "apt-get install ${missing[*]} failed (log: $data/apt.log)"; }
  fi
}

go_install() {
  # go_install BINARY MODULE@VERSION: build a pinned Go binary into .bin/.
  local name=$1 mod=$2 version=${2##*@}
  if [[ -x $bin/$name && -f $bin/$name.version && $(cat "$bin/$name.version") == "$version" ]]; then
    return 0
  fi
  log "building $name $version (go install)"
  GOBIN=$bin go install "$mod"
  echo "$version" >"$bin/$name.version"
}

# --- PostgreSQL -------------------------------------------------------------

# as_postgres CMD...: run CMD as the postgres user, from a directory it can read.
as_postgres() { (cd / && runuser -u postgres -- "$@"); }

# pg_dir: the cluster's directory. It must be reachable by the postgres user;
# a checkout under a private directory (mktemp -d, a home directory) is not,
# so the cluster then lives under /var/tmp, named after the checkout.
pg_dir() {
  if as_postgres test -x "$data" 2>/dev/null; then
    echo "$data/postgres"
  else
    echo "/var/tmp/fanout-$(printf '%s' "$data" | sha256sum | cut -c1-12)/postgres"
  fi
}

pg_up() {
  local dir; dir=$(pg_dir)
  if "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$POSTGRES_PORT"; then
    log "postgres already answering on 127.0.0.1:$POSTGRES_PORT"
  else
    # PostgreSQL refuses to run as root: the cluster belongs to the postgres
    # user that the Debian package creates.
    mkdir -p "$dir"
    chown postgres:postgres "$dir"
    chmod 700 "$dir"
    if [[ ! -f $dir/PG_VERSION ]]; then
      log "initdb $dir"
      as_postgres "$pg_bin/initdb" -D "$dir" -U postgres --auth=trust \
        --encoding=UTF8 --locale=C.UTF-8 >"$data/postgres-initdb.log" 2>&1 ||
        { cat "$data/postgres-initdb.log" >&2; die "initdb failed"; }
    fi
    # Everything on the command line, so the cluster's own files need no edits.
    # wal_level=logical lets a relay in relay.capture wal decode the outbox
    # from a replication slot (each test database may have one).
    as_postgres "$pg_bin/pg_ctl" -D "$dir" -l "$dir/postgres.log" -w -t 60 start \
      -o "-c listen_addresses=127.0.0.1 -p $POSTGRES_PORT -c unix_socket_directories=/tmp \
          -c max_connections=300 -c shared_buffers=256MB \
          -c wal_level=logical -c max_replication_slots=200 -c max_wal_senders=200" >/dev/null ||
      { tail -30 "$dir/postgres.log" >&2; die "postgres did not start"; }
  fi
  wait_for postgres 60 "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$POSTGRES_PORT"
  # The application role and database (trust auth on loopback: this is a
  # development cluster; production credentials come from config).
  psql -q -h 127.0.0.1 -p "$POSTGRES_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 <<'SQL' >/dev/null
SELECT 'CREATE ROLE fanout LOGIN CREATEDB CREATEROLE'
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'fanout') \gexec
SELECT 'CREATE DATABASE fanout OWNER fanout'
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'fanout') \gexec
SQL
  log "postgres $("$pg_bin/postgres" --version | awk '{print $3}') on postgres://fanout@127.0.0.1:$POSTGRES_PORT/fanout (data $dir)"
}

pg_down() {
  local dir; dir=$(pg_dir)
  [[ -f $dir/postmaster.pid ]] || return 0
  as_postgres "$pg_bin/pg_ctl" -D "$dir" -m fast -w stop >/dev/null 2>&1 || true
  log "postgres stopped"
}

# --- Redis ------------------------------------------------------------------

redis_up() {
  local dir=$data/redis
  mkdir -p "$dir"
  if redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; then
    log "redis already answering on 127.0.0.1:$REDIS_PORT"
  else
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$dir" --daemonize yes \
      --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --save '' --appendonly no
  fi
  wait_for redis 30 sh -c "redis-cli -h 127.0.0.1 -p $REDIS_PORT ping | grep -q PONG"
  log "redis $(redis-server --version | awk '{print $3}' | tr -d v=) on redis://127.0.0.1:$REDIS_PORT (data $dir)"
}

redis_down() {
  redis-cli -h 127.0.0.1 -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 && log "redis stopped" || true
}

# --- NATS -------------------------------------------------------------------

nats_healthy() { curl -fsS "http://127.0.0.1:$NATS_MONITOR_PORT/healthz?js-enabled-only=true" >/dev/null 2>&1; }

nats_up() {
  local dir=$data/nats
  mkdir -p "$dir"
  if nats_healthy; then
    log "nats-server already answering on 127.0.0.1:$NATS_PORT"
  else
    nohup "$bin/nats-server" -c "$repo/deploy/nats/dev.conf" -a 127.0.0.1 -p "$NATS_PORT" \
      -m "$NATS_MONITOR_PORT" -js -sd "$dir/jetstream" -P "$dir/nats-server.pid" \
      -l "$dir/nats-server.log" >/dev/null 2>&1 &
    wait_for nats-server 30 nats_healthy
  fi
  local cli="CLI: $bin/nats"
  if [[ ! -x $bin/nats ]]; then
    if [[ ${FANOUT_DEV_NATS_CLI:-} == background ]]; then
      cli="CLI: $bin/nats, building in the background, log $data/install-nats.log"
    else
      cli="no CLI: go tool task services builds it"
    fi
  fi
  log "nats-server $("$bin/nats-server" --version | awk '{print $2}') with JetStream on nats://127.0.0.1:$NATS_PORT (monitor :$NATS_MONITOR_PORT, data $dir; $cli)"
}

nats_down() {
  local pidfile=$data/nats/nats-server.pid
  [[ -f $pidfile ]] || return 0
  local pid; pid=$(cat "$pidfile")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    log "nats-server stopped"
  fi
  rm -f "$pidfile"
}

# --- OpenSearch -------------------------------------------------------------

search_up() {
  FANOUT_DEV_OPENSEARCH_PORT=$OPENSEARCH_PORT "$repo/deploy/opensearch/start.sh"
}

search_down() {
  if [[ -x $repo/deploy/opensearch/stop.sh ]]; then
    "$repo/deploy/opensearch/stop.sh" || true
  fi
}

# --- Installing, all at once -------------------------------------------------

# install_all installs what is missing, each kind of install in the
# background beside the others: on a fresh machine the Debian packages, the
# two Go builds and the Maven download take minutes each, mostly waiting on
# the network, so side by side they take about as long as the slowest.
install_all() {
  local names=() pids=()
  spawn() { # spawn NAME CMD...: run CMD in the background, its output in a log
    local name=$1; shift
    ("$@") >"$data/install-$name.log" 2>&1 &
    names+=("$name"); pids+=($!)
  }
  spawn apt apt_install \
    "postgresql-$POSTGRES_MAJOR=$POSTGRES_DEB_VERSION" "postgresql-client-$POSTGRES_MAJOR=$POSTGRES_DEB_VERSION" \
    "redis-server=$REDIS_DEB_VERSION" "redis-tools=$REDIS_DEB_VERSION"
  spawn nats-server go_install nats-server "github.com/nats-io/nats-server/v2@$NATS_SERVER_VERSION"
  # The nats CLI is for people and the docs test (cmd/fanout), which checks
  # the docs' nats commands with it: no service needs it. It builds at the
  # lowest CPU priority, so on a fresh machine it takes only the CPU the
  # builds that are needed leave idle, and `task up` does not wait for it.
  local cli=(nice -n 19 bash "$repo/deploy/services.sh" nats-cli)
  case ${FANOUT_DEV_NATS_CLI:-wait} in
    wait) spawn nats "${cli[@]}" ;;
    background) setsid nohup "${cli[@]}" >"$data/install-nats.log" 2>&1 </dev/null & ;;
    skip) ;;
    *) die "FANOUT_DEV_NATS_CLI must be wait, background or skip (got ${FANOUT_DEV_NATS_CLI})" ;;
  esac
  if [[ ${FANOUT_DEV_SKIP_SEARCH:-} != 1 ]]; then
    spawn opensearch "$repo/deploy/opensearch/start.sh" --build-only
  fi
  local failed=()
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then failed+=("${names[$i]}"); fi
    cat "$data/install-${names[$i]}.log"
  done
  ((${#failed[@]} == 0)) || die "installing ${failed[*]} failed (logs: $data/install-*.log)"
}

# ----------------------------------------------------------------------------

cmd=${1:-up}
mkdir -p "$data" "$bin"
case $cmd in
  up)
    install_all
    # OpenSearch's JVM takes the longest to answer: it starts first, in
    # the background, while the others start.
    search_pid=
    if [[ ${FANOUT_DEV_SKIP_SEARCH:-} != 1 ]]; then
      search_up >"$data/start-opensearch.log" 2>&1 &
      search_pid=$!
    fi
    pg_up
    redis_up
    nats_up
    if [[ -n $search_pid ]]; then
      wait "$search_pid" || { cat "$data/start-opensearch.log" >&2; die "opensearch did not start"; }
      cat "$data/start-opensearch.log"
    fi
    log "all services up"
    ;;
  nats-cli)
    # One build at a time: the docs test runs this too, and then waits for
    # the build `up` started in the background instead of starting another.
    exec 9>"$bin/.nats-cli.lock"
    flock 9
    go_install nats "github.com/nats-io/natscli/nats@$NATSCLI_VERSION"
    log "nats CLI ready: $bin/nats"
    ;;
  down)
    search_down
    nats_down
    redis_down
    pg_down
    ;;
  status)
    "$pg_bin/pg_isready" -h 127.0.0.1 -p "$POSTGRES_PORT" || true
    redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>&1 || true
    nats_healthy && echo "nats-server: healthy on 127.0.0.1:$NATS_PORT" || echo "nats-server: down"
    curl -fsS "http://127.0.0.1:$OPENSEARCH_PORT/_cluster/health" 2>&1 || echo "opensearch: down"
    ;;
  *) die "usage: $0 up|down|status|nats-cli" ;;
esac
