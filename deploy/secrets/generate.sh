#!/usr/bin/env bash
# Writes a random password into each missing secret file compose.yaml mounts.
# Letters and digits only, starting with a letter: nats-server parses its
# passwords as config values (see nats/nats-server.conf).
set -euo pipefail
cd "$(dirname "$0")"
umask 077
for name in pg_superuser pg_migrate pg_relay pg_invoicing pg_cacheinval pg_searchindex pg_salesledger \
            nats_relay nats_invoicing nats_cacheinval nats_searchindex nats_salesledger nats_admin redis es; do
  f=${name}_password
  [[ -s $f ]] && continue
  printf 'p%s' "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')" >"$f"
  echo "wrote $f"
done
