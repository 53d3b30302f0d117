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

# The NATS server's certificate (nats_tls_cert, nats_tls_key), valid for
# the name compose gives it (nats) and for localhost, signed by a CA made
# here (nats_ca), which every role checks the server with. The CA's key,
# nats_ca_key, stays in this directory (0600) and compose mounts it
# nowhere: keep it to sign more certificates, or delete it. To use your own
# CA, put its certificate and the server's in these files before running.
if [[ ! -s nats_ca || ! -s nats_tls_cert || ! -s nats_tls_key ]]; then
  if ! command -v openssl >/dev/null; then
    echo "generate.sh: openssl is needed to make the NATS server's certificate (or put yours in nats_ca, nats_tls_cert and nats_tls_key)" >&2
    exit 1
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  serial() { printf '0x%s' "$(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n')"; }
  (
    umask 077
    openssl ecparam -name prime256v1 -genkey -noout -out nats_ca_key
    openssl req -new -key nats_ca_key -subj "/CN=fanout NATS CA" -out "$tmp/ca.csr"
    printf 'basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n' >"$tmp/ca.ext"
    openssl x509 -req -in "$tmp/ca.csr" -signkey nats_ca_key -days 3650 -set_serial "$(serial)" -extfile "$tmp/ca.ext" -out nats_ca 2>/dev/null
    openssl ecparam -name prime256v1 -genkey -noout -out nats_tls_key
    openssl req -new -key nats_tls_key -subj "/CN=nats" -out "$tmp/server.csr"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:nats,DNS:localhost,IP:127.0.0.1\n' >"$tmp/server.ext"
    openssl x509 -req -in "$tmp/server.csr" -CA nats_ca -CAkey nats_ca_key -days 825 -set_serial "$(serial)" -extfile "$tmp/server.ext" -out nats_tls_cert 2>/dev/null
  )
  echo "wrote nats_ca, nats_tls_cert, nats_tls_key (and nats_ca_key, the CA's key, mounted nowhere)"
fi
chmod 0644 nats_ca nats_tls_cert nats_tls_key
if [[ -e nats_ca_key ]]; then chmod 0600 nats_ca_key; fi
