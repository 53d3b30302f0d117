#!/usr/bin/env bash
# Written by `fanout deploy render` from the subscribers' declarations
# (subscribers/registry): edit the template in deploy/templates, not this
# file.
#
# Writes a random password into each missing secret file compose.yaml mounts.
# Letters and digits only, starting with a letter: nats-server parses its
# passwords as config values (see nats/nats-server.conf).
#
# Modes: the fanout image runs as the distroless nonroot user (uid 65532),
# not as the files' owner, and Compose bind-mounts file secrets as they are
# (it cannot change their owner or mode). So each file is readable by all
# (0644) and the directory by its owner only (0700): other users of the host
# cannot reach the files, the containers can read the ones mounted into them.
# deploy/secrets_test.go checks both against the image's user.
set -euo pipefail
cd "$(dirname "$0")"
chmod 0700 .
for name in pg_superuser pg_migrate pg_relay pg_operator nats_relay nats_provisioner nats_operator nats_admin nats_admin_deadletter redis es \
            pg_cacheinval nats_cacheinval \
            pg_fulfilment nats_fulfilment \
            pg_invoicing nats_invoicing \
            pg_salesledger nats_salesledger \
            pg_searchindex nats_searchindex es_searchindex \
            ; do
  f=${name}_password
  if [[ ! -s $f ]]; then
    (umask 077 && printf 'p%s' "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')" >"$f")
    echo "wrote $f"
  fi
  chmod 0644 "$f"
done
