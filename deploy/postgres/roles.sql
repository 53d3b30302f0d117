-- Written by `fanout deploy render` from the subscribers' declarations
-- (subscribers/registry): edit the template in deploy/templates, or a
-- subscriber's Grants, not this file.
--
-- fanout's PostgreSQL roles, each with the least privilege its code needs.
--
-- A DBA runs this with psql, as a superuser, connected to the database that
-- holds (or will hold) fanout's tables:
--
--   psql -X -v ON_ERROR_STOP=1 -f deploy/postgres/roles.sql "postgres://postgres@db-host/shop"
--
-- It is idempotent and converges: every run revokes what the fanout roles
-- hold on the tables in schema public and grants the lists below again, in
-- one transaction. Run it
--   1. before the first migration: it creates the roles and lets
--      fanout_migrate create tables (the table grants are skipped, with a
--      notice, while the schema is missing);
--   2. after `fanout migrate` (run as fanout_migrate), and again after any
--      migration that adds a table a role needs (add the grant here first).
-- Roles are cluster-wide; grants, ownership and policies are per database.
-- Do not run it in two sessions at once (CREATE ROLE would race).
--
-- Roles:
--   fanout_migrate      LOGIN. Owns fanout's tables and sequences (ownership
--                       of existing ones is transferred to it); CREATE on
--                       schema public, and on the database for the outbox's
--                       publication (CREATE PUBLICATION needs it). Runs
--                       `fanout migrate`.
--   fanout_relay        LOGIN. outbox: SELECT, DELETE, and UPDATE of the
--                       bookkeeping columns only (status, attempts,
--                       last_error, available_at, claimed_at, lease_token,
--                       published_at): it claims, marks, reaps and deletes
--                       rows but cannot change an event or write one.
--                       LISTEN needs no privilege. outbox_epochs: SELECT,
--                       and EXECUTE on fanout_outbox_last_id,
--                       fanout_outbox_state and fanout_outbox_new_epoch
--                       (a restore that rewound the ids). relay_capture: SELECT,
--                       INSERT, UPDATE, DELETE (a wal relay's bookkeeping).
--                       The audit: outbox_landings SELECT, INSERT;
--                       outbox_audit_state SELECT, UPDATE; outbox_audits
--                       SELECT, INSERT, DELETE; outbox_partitions UPDATE
--                       (audited_at).
--                       The outbox's retention: EXECUTE on the functions
--                       that add, seal, analyze and drop its ranges
--                       (SECURITY DEFINER, owned by fanout_migrate: the
--                       relay owns no table), SELECT on outbox_partitions, and on
--                       outbox_default, which holds the rows no range
--                       does, what it has on outbox, to delete them.
--                       With relay_capture=wal (psql -v relay_capture=wal)
--                       it also gets REPLICATION, to create and stream its
--                       replication slot; with poll (the default) it is
--                       NOREPLICATION. Switching back from wal to poll,
--                       the poll relays stream and drop the slot: run this
--                       file with relay_capture=poll only once they have
--                       logged "switched from wal to poll capture".
--   fanout_writer       NOLOGIN group role: GRANT it to each application role
--                       that writes events. outbox: INSERT of the event
--                       columns (aggregate_type, aggregate_id, event_type,
--                       payload, headers) and SELECT (id) for RETURNING id.
--                       Postgres writes an event only for a session whose
--                       login role is declared for its type, or a member
--                       of one (fanout outbox writers; fanout_writer is
--                       declared for every type until you withdraw it).
--                       pg_notify needs no privilege. The identity column
--                       needs no USAGE on outbox_id_seq.
--   fanout_cacheinval: LOGIN. Its own checkpoint rows in processed_events
--       and its own rows in subscriber_attempts, dead_letters;
--       event_origins (SELECT; EXECUTE on fanout_origin_number), outbox_epochs (SELECT),
--       and its replays (EXECUTE on fanout_replay_take, fanout_replay_finish); and
--       SELECT ON products, brands, categories, inventory
--   fanout_fulfilment: LOGIN. Its own checkpoint rows in processed_events
--       and its own rows in subscriber_attempts, dead_letters and subscriber_aggregates;
--       event_origins (SELECT; EXECUTE on fanout_origin_number), outbox_epochs (SELECT),
--       and its replays (EXECUTE on fanout_replay_take, fanout_replay_finish); and
--       SELECT, INSERT, UPDATE ON fulfilment_orders
--       SELECT, INSERT ON fulfilment_history, fulfilment_violations
--   fanout_invoicing: LOGIN. Its own checkpoint rows in processed_events
--       and its own rows in subscriber_attempts, dead_letters;
--       event_origins (SELECT; EXECUTE on fanout_origin_number), outbox_epochs (SELECT),
--       and its replays (EXECUTE on fanout_replay_take, fanout_replay_finish); and
--       SELECT ON orders, order_lines, products
--       INSERT ON invoices, invoice_lines
--       SELECT (id, order_id) ON invoices
--       USAGE ON SEQUENCE invoice_number_seq
--       SELECT ON orders
--   fanout_salesledger: LOGIN. Its own checkpoint rows in processed_events
--       and its own rows in subscriber_attempts, dead_letters;
--       event_origins (SELECT; EXECUTE on fanout_origin_number), outbox_epochs (SELECT),
--       and its replays (EXECUTE on fanout_replay_take, fanout_replay_finish); and
--       SELECT ON orders, order_lines
--       SELECT, INSERT, UPDATE ON product_sales
--   fanout_searchindex: LOGIN. Its own checkpoint rows in processed_events
--       and its own rows in subscriber_attempts, dead_letters;
--       event_origins (SELECT; EXECUTE on fanout_origin_number), outbox_epochs (SELECT),
--       and its replays (EXECUTE on fanout_replay_take, fanout_replay_finish); and
--       SELECT ON products, brands, categories, inventory
--   fanout_operator     LOGIN. The operator commands (fanout status, dlq,
--                       outbox, reindex). A member of each subscriber role:
--                       a dead letter's redrive runs that subscriber's
--                       handler with its checkpoint, and a reindex reads the
--                       catalog as the search indexer does. outbox: SELECT,
--                       and UPDATE of the bookkeeping columns (retry-failed,
--                       republish return rows to pending); it cannot write
--                       or change an event. dead_letter_actions: SELECT,
--                       and EXECUTE on fanout_dead_letter_action, the only
--                       way to add to it (it records the session's role as
--                       the actor): the audit trail is append-only and says
--                       who. dead_letters: SELECT. replays: SELECT, and
--                       EXECUTE on fanout_replay_request and
--                       fanout_replay_outcome: it asks for a replay, which
--                       the subscriber carries out (it holds no reset of a
--                       subscriber's consumer in NATS).
--                       relay_capture, outbox_partitions, outbox_default,
--                       outbox_epochs, event_origins, outbox_audits,
--                       outbox_audit_state: SELECT (fanout status).
--
-- processed_events, subscriber_attempts and dead_letters have row-level security: each
-- subscriber role sees and writes only the rows of its own subscriber name
-- (cacheinval, fulfilment, invoicing, salesledger, searchindex), so one
-- subscriber cannot skip, replay or dead-letter another's events. The table
-- owner (fanout_migrate) and superusers bypass it.
--
-- Passwords are not in this file. For each LOGIN role, if the matching
-- variable is set in psql's environment, the role's password is set from it:
--   FANOUT_PG_MIGRATE_PASSWORD, FANOUT_PG_RELAY_PASSWORD,
--   FANOUT_PG_CACHEINVAL_PASSWORD,
--   FANOUT_PG_FULFILMENT_PASSWORD,
--   FANOUT_PG_INVOICING_PASSWORD,
--   FANOUT_PG_SALESLEDGER_PASSWORD,
--   FANOUT_PG_SEARCHINDEX_PASSWORD,
--   FANOUT_PG_OPERATOR_PASSWORD.
-- The value may be a SCRAM-SHA-256 verifier (SCRAM-SHA-256$4096:...), which
-- PostgreSQL stores as is; a plain password travels to the server in the
-- ALTER ROLE statement, so make sure log_statement does not log DDL then, or
-- leave the variables unset and use psql's \password (which hashes on the
-- client). Unset variables leave passwords as they are. Each fanout process
-- gets its password through postgres.password or postgres.password_file.

\set ON_ERROR_STOP on

-- relay.capture of the relays that will log in as fanout_relay: poll (the
-- default) or wal.
\if :{?relay_capture}
\else
\set relay_capture poll
\endif
SELECT :'relay_capture' IN ('poll', 'wal') AS fanout_capture_known, :'relay_capture' = 'wal' AS fanout_capture_wal \gset
\if :fanout_capture_known
\else
\echo 'roles.sql: relay_capture must be poll or wal, got' :'relay_capture'
DO $$ BEGIN RAISE EXCEPTION 'roles.sql stopped: relay_capture must be poll or wal'; END $$;
\endif

BEGIN;

-- Roles -----------------------------------------------------------------------

SELECT format('CREATE ROLE %I', r)
FROM unnest(ARRAY['fanout_migrate', 'fanout_relay', 'fanout_writer', 'fanout_operator', 'fanout_cacheinval', 'fanout_fulfilment', 'fanout_invoicing', 'fanout_salesledger', 'fanout_searchindex']) AS r
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = r) \gexec

ALTER ROLE fanout_migrate     LOGIN   NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE fanout_relay       LOGIN   NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
\if :fanout_capture_wal
ALTER ROLE fanout_relay REPLICATION;
\endif
ALTER ROLE fanout_writer      NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE fanout_cacheinval LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE fanout_fulfilment LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE fanout_invoicing LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE fanout_salesledger LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE fanout_searchindex LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;
ALTER ROLE fanout_operator    LOGIN   NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT;

-- Passwords, from psql's environment when set.
\unset fanout_password
\getenv fanout_password FANOUT_PG_MIGRATE_PASSWORD
\if :{?fanout_password}
ALTER ROLE fanout_migrate PASSWORD :'fanout_password';
\unset fanout_password
\endif
\getenv fanout_password FANOUT_PG_RELAY_PASSWORD
\if :{?fanout_password}
ALTER ROLE fanout_relay PASSWORD :'fanout_password';
\unset fanout_password
\endif
\getenv fanout_password FANOUT_PG_CACHEINVAL_PASSWORD
\if :{?fanout_password}
ALTER ROLE fanout_cacheinval PASSWORD :'fanout_password';
\unset fanout_password
\endif
\getenv fanout_password FANOUT_PG_FULFILMENT_PASSWORD
\if :{?fanout_password}
ALTER ROLE fanout_fulfilment PASSWORD :'fanout_password';
\unset fanout_password
\endif
\getenv fanout_password FANOUT_PG_INVOICING_PASSWORD
\if :{?fanout_password}
ALTER ROLE fanout_invoicing PASSWORD :'fanout_password';
\unset fanout_password
\endif
\getenv fanout_password FANOUT_PG_SALESLEDGER_PASSWORD
\if :{?fanout_password}
ALTER ROLE fanout_salesledger PASSWORD :'fanout_password';
\unset fanout_password
\endif
\getenv fanout_password FANOUT_PG_SEARCHINDEX_PASSWORD
\if :{?fanout_password}
ALTER ROLE fanout_searchindex PASSWORD :'fanout_password';
\unset fanout_password
\endif
\getenv fanout_password FANOUT_PG_OPERATOR_PASSWORD
\if :{?fanout_password}
ALTER ROLE fanout_operator PASSWORD :'fanout_password';
\unset fanout_password
\endif

-- The operator acts as each subscriber when it redrives that subscriber's
-- dead letters (and as the search indexer when it reindexes).
GRANT fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex TO fanout_operator;

-- Database and schema ---------------------------------------------------------

SELECT current_database() AS fanout_database \gset
GRANT CONNECT ON DATABASE :"fanout_database"
    TO fanout_migrate, fanout_relay, fanout_operator, fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex;

GRANT CREATE ON DATABASE :"fanout_database" TO fanout_migrate;
GRANT USAGE, CREATE ON SCHEMA public TO fanout_migrate;
GRANT USAGE ON SCHEMA public
    TO fanout_relay, fanout_writer, fanout_operator, fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex;

-- Tables (once migrated) --------------------------------------------------------

SELECT bool_and(to_regclass(format('public.%I', t)) IS NOT NULL) AS fanout_migrated
FROM unnest(ARRAY['outbox', 'processed_events', 'subscriber_attempts', 'brands', 'categories',
                  'products', 'inventory', 'orders', 'order_lines', 'invoices', 'invoice_lines',
                  'invoice_number_seq', 'dead_letter_actions', 'dead_letters', 'replays', 'relay_capture',
                  'outbox_partitions', 'outbox_default', 'outbox_aggregates', 'subscriber_aggregates',
                  'outbox_epochs', 'event_origins', 'outbox_landings', 'outbox_audit_state', 'outbox_audits',
                  'order_transitions', 'subscriber_backfills', 'subscriber_backfill_segments', 'subscriber_backfill_failures', 'fulfilment_history', 'fulfilment_orders', 'fulfilment_violations', 'product_sales']) AS t \gset

\if :fanout_migrated

-- fanout_migrate owns what fanout's migrations created (sequences owned by a
-- column follow their table).
SELECT format('ALTER TABLE public.%I OWNER TO fanout_migrate', c.relname)
FROM pg_class c
WHERE c.relnamespace = 'public'::regnamespace
  AND c.relkind IN ('r', 'p')
  AND c.relname IN ('fanout_schema_version', 'outbox', 'processed_events', 'subscriber_attempts',
                    'brands', 'categories', 'products', 'inventory', 'orders', 'order_lines',
                    'invoices', 'invoice_lines', 'dead_letter_actions', 'dead_letters', 'replays', 'relay_capture',
                    'outbox_partitions', 'outbox_aggregates', 'subscriber_aggregates',
                    'outbox_epochs', 'event_origins', 'origin_databases', 'outbox_writer_types', 'outbox_landings', 'outbox_audit_state', 'outbox_audits',
                    'order_transitions', 'subscriber_backfills', 'subscriber_backfill_segments', 'subscriber_backfill_failures', 'fulfilment_history', 'fulfilment_orders', 'fulfilment_violations', 'product_sales')
  AND c.relowner <> 'fanout_migrate'::regrole \gexec
-- The outbox's ranges, and the functions that add and drop them (which
-- must own the outbox to do so).
SELECT format('ALTER TABLE public.%I OWNER TO fanout_migrate', c.relname)
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'public.outbox'::regclass AND c.relowner <> 'fanout_migrate'::regrole \gexec
SELECT format('ALTER FUNCTION %s OWNER TO fanout_migrate', p.oid::regprocedure)
FROM pg_proc p
WHERE p.pronamespace = 'public'::regnamespace
  AND (p.proname LIKE 'fanout\_outbox\_%' OR p.proname LIKE 'fanout\_replay\_%' OR p.proname IN ('fanout_dead_letter_action', 'fanout_origin_number', 'fanout_origin_allow'))
  AND p.proowner <> 'fanout_migrate'::regrole \gexec
SELECT 'ALTER SEQUENCE public.invoice_number_seq OWNER TO fanout_migrate'
WHERE (SELECT relowner FROM pg_class WHERE oid = 'public.invoice_number_seq'::regclass)
      <> 'fanout_migrate'::regrole \gexec

-- Start from nothing, so that a run converges on the lists below.
REVOKE ALL ON ALL TABLES IN SCHEMA public
    FROM fanout_relay, fanout_writer, fanout_operator, fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public
    FROM fanout_relay, fanout_writer, fanout_operator, fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex;

-- The relay.
GRANT SELECT, DELETE ON outbox TO fanout_relay;
GRANT UPDATE (status, attempts, last_error, available_at, claimed_at, lease_token, published_at)
    ON outbox TO fanout_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON relay_capture TO fanout_relay;
GRANT SELECT, DELETE ON outbox_default TO fanout_relay;
GRANT UPDATE (status, attempts, last_error, available_at, claimed_at, lease_token, published_at)
    ON outbox_default TO fanout_relay;
GRANT SELECT ON outbox_partitions TO fanout_relay;
GRANT EXECUTE ON FUNCTION fanout_outbox_extend(bigint, integer, bigint), fanout_outbox_seal(text),
    fanout_outbox_retire(text, interval, boolean, pg_lsn, bigint, boolean), fanout_outbox_analyze(bigint) TO fanout_relay;
-- The audit of the stream against the outbox: where each event landed,
-- the audit's progress and record, and a range's audit.
GRANT SELECT, INSERT ON outbox_landings TO fanout_relay;
GRANT SELECT, UPDATE ON outbox_audit_state TO fanout_relay;
GRANT SELECT, INSERT, DELETE ON outbox_audits TO fanout_relay;
GRANT UPDATE (audited_at) ON outbox_partitions TO fanout_relay;
-- The events' origin: the outbox's epochs, the last id it handed out, and
-- a new epoch when a restore rewound the ids.
GRANT SELECT ON outbox_epochs TO fanout_relay;
GRANT EXECUTE ON FUNCTION fanout_outbox_last_id(), fanout_outbox_state(),
    fanout_outbox_new_epoch(integer, integer, bigint, bigint, text) TO fanout_relay;

-- Writers (outbox.Write, outbox.Queue).
GRANT INSERT (aggregate_type, aggregate_id, event_type, payload, headers) ON outbox TO fanout_writer;
GRANT SELECT (id) ON outbox TO fanout_writer;

-- Subscribers: the numbers of the origins their checkpoints key on (shared:
-- an origin is a fact, not a subscriber's; numbered only through
-- fanout_origin_number, which takes nothing that is not an origin), and
-- the epochs of their own database.
GRANT SELECT ON event_origins TO fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex;
GRANT EXECUTE ON FUNCTION fanout_origin_number(text) TO fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex;
GRANT SELECT ON outbox_epochs TO fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex;

-- Subscribers: the replays the operator asks for, each carried out by the
-- subscriber it moves (migration 00027: the functions check that the
-- session's role acts for the request's subscriber).
GRANT EXECUTE ON FUNCTION fanout_replay_take(text), fanout_replay_finish(bigint, text)
    TO fanout_cacheinval, fanout_fulfilment, fanout_invoicing, fanout_salesledger, fanout_searchindex;

-- Subscribers: the checkpoint (insert, read, prune), restricted to their rows.
ALTER TABLE processed_events ENABLE ROW LEVEL SECURITY;
GRANT SELECT, INSERT, DELETE ON processed_events TO fanout_cacheinval;
DROP POLICY IF EXISTS fanout_cacheinval_checkpoints ON processed_events;
CREATE POLICY fanout_cacheinval_checkpoints ON processed_events TO fanout_cacheinval
    USING (subscriber = 'cacheinval') WITH CHECK (subscriber = 'cacheinval');
GRANT SELECT, INSERT, DELETE ON processed_events TO fanout_fulfilment;
DROP POLICY IF EXISTS fanout_fulfilment_checkpoints ON processed_events;
CREATE POLICY fanout_fulfilment_checkpoints ON processed_events TO fanout_fulfilment
    USING (subscriber = 'fulfilment') WITH CHECK (subscriber = 'fulfilment');
GRANT SELECT, INSERT, DELETE ON processed_events TO fanout_invoicing;
DROP POLICY IF EXISTS fanout_invoicing_checkpoints ON processed_events;
CREATE POLICY fanout_invoicing_checkpoints ON processed_events TO fanout_invoicing
    USING (subscriber = 'invoicing') WITH CHECK (subscriber = 'invoicing');
GRANT SELECT, INSERT, DELETE ON processed_events TO fanout_salesledger;
DROP POLICY IF EXISTS fanout_salesledger_checkpoints ON processed_events;
CREATE POLICY fanout_salesledger_checkpoints ON processed_events TO fanout_salesledger
    USING (subscriber = 'salesledger') WITH CHECK (subscriber = 'salesledger');
GRANT SELECT, INSERT, DELETE ON processed_events TO fanout_searchindex;
DROP POLICY IF EXISTS fanout_searchindex_checkpoints ON processed_events;
CREATE POLICY fanout_searchindex_checkpoints ON processed_events TO fanout_searchindex
    USING (subscriber = 'searchindex') WITH CHECK (subscriber = 'searchindex');

-- Subscribers: what the runtime remembers of failed and redelivered events
-- (failures, attempts whose process died), restricted to their rows.
ALTER TABLE subscriber_attempts ENABLE ROW LEVEL SECURITY;
GRANT SELECT, INSERT, UPDATE, DELETE ON subscriber_attempts TO fanout_cacheinval;
DROP POLICY IF EXISTS fanout_cacheinval_attempts ON subscriber_attempts;
CREATE POLICY fanout_cacheinval_attempts ON subscriber_attempts TO fanout_cacheinval
    USING (subscriber = 'cacheinval') WITH CHECK (subscriber = 'cacheinval');
GRANT SELECT, INSERT, UPDATE, DELETE ON subscriber_attempts TO fanout_fulfilment;
DROP POLICY IF EXISTS fanout_fulfilment_attempts ON subscriber_attempts;
CREATE POLICY fanout_fulfilment_attempts ON subscriber_attempts TO fanout_fulfilment
    USING (subscriber = 'fulfilment') WITH CHECK (subscriber = 'fulfilment');
GRANT SELECT, INSERT, UPDATE, DELETE ON subscriber_attempts TO fanout_invoicing;
DROP POLICY IF EXISTS fanout_invoicing_attempts ON subscriber_attempts;
CREATE POLICY fanout_invoicing_attempts ON subscriber_attempts TO fanout_invoicing
    USING (subscriber = 'invoicing') WITH CHECK (subscriber = 'invoicing');
GRANT SELECT, INSERT, UPDATE, DELETE ON subscriber_attempts TO fanout_salesledger;
DROP POLICY IF EXISTS fanout_salesledger_attempts ON subscriber_attempts;
CREATE POLICY fanout_salesledger_attempts ON subscriber_attempts TO fanout_salesledger
    USING (subscriber = 'salesledger') WITH CHECK (subscriber = 'salesledger');
GRANT SELECT, INSERT, UPDATE, DELETE ON subscriber_attempts TO fanout_searchindex;
DROP POLICY IF EXISTS fanout_searchindex_attempts ON subscriber_attempts;
CREATE POLICY fanout_searchindex_attempts ON subscriber_attempts TO fanout_searchindex
    USING (subscriber = 'searchindex') WITH CHECK (subscriber = 'searchindex');

-- Ordered subscribers: their per-aggregate checkpoint, restricted to their
-- rows (rows are kept: no DELETE).
ALTER TABLE subscriber_aggregates ENABLE ROW LEVEL SECURITY;
GRANT SELECT, INSERT, UPDATE ON subscriber_aggregates TO fanout_fulfilment;
DROP POLICY IF EXISTS fanout_fulfilment_aggregates ON subscriber_aggregates;
CREATE POLICY fanout_fulfilment_aggregates ON subscriber_aggregates TO fanout_fulfilment
    USING (subscriber = 'fulfilment') WITH CHECK (subscriber = 'fulfilment');

-- Subscribers: the events each dead-lettered, vouching for its letters;
-- restricted to their rows (kept: no UPDATE or DELETE).
ALTER TABLE dead_letters ENABLE ROW LEVEL SECURITY;
GRANT SELECT, INSERT ON dead_letters TO fanout_cacheinval;
DROP POLICY IF EXISTS fanout_cacheinval_dead_letters ON dead_letters;
CREATE POLICY fanout_cacheinval_dead_letters ON dead_letters TO fanout_cacheinval
    USING (subscriber = 'cacheinval') WITH CHECK (subscriber = 'cacheinval');
GRANT SELECT, INSERT ON dead_letters TO fanout_fulfilment;
DROP POLICY IF EXISTS fanout_fulfilment_dead_letters ON dead_letters;
CREATE POLICY fanout_fulfilment_dead_letters ON dead_letters TO fanout_fulfilment
    USING (subscriber = 'fulfilment') WITH CHECK (subscriber = 'fulfilment');
GRANT SELECT, INSERT ON dead_letters TO fanout_invoicing;
DROP POLICY IF EXISTS fanout_invoicing_dead_letters ON dead_letters;
CREATE POLICY fanout_invoicing_dead_letters ON dead_letters TO fanout_invoicing
    USING (subscriber = 'invoicing') WITH CHECK (subscriber = 'invoicing');
GRANT SELECT, INSERT ON dead_letters TO fanout_salesledger;
DROP POLICY IF EXISTS fanout_salesledger_dead_letters ON dead_letters;
CREATE POLICY fanout_salesledger_dead_letters ON dead_letters TO fanout_salesledger
    USING (subscriber = 'salesledger') WITH CHECK (subscriber = 'salesledger');
GRANT SELECT, INSERT ON dead_letters TO fanout_searchindex;
DROP POLICY IF EXISTS fanout_searchindex_dead_letters ON dead_letters;
CREATE POLICY fanout_searchindex_dead_letters ON dead_letters TO fanout_searchindex
    USING (subscriber = 'searchindex') WITH CHECK (subscriber = 'searchindex');

-- Subscribers that declare a backfill: where it is, and the rows it could
-- not apply, restricted to their rows.
ALTER TABLE subscriber_backfills ENABLE ROW LEVEL SECURITY;
ALTER TABLE subscriber_backfill_segments ENABLE ROW LEVEL SECURITY;
ALTER TABLE subscriber_backfill_failures ENABLE ROW LEVEL SECURITY;
GRANT SELECT, INSERT, UPDATE ON subscriber_backfills TO fanout_invoicing;
DROP POLICY IF EXISTS fanout_invoicing_backfills ON subscriber_backfills;
CREATE POLICY fanout_invoicing_backfills ON subscriber_backfills TO fanout_invoicing
    USING (subscriber = 'invoicing') WITH CHECK (subscriber = 'invoicing');
GRANT SELECT, INSERT, UPDATE, DELETE ON subscriber_backfill_segments TO fanout_invoicing;
DROP POLICY IF EXISTS fanout_invoicing_backfill_segments ON subscriber_backfill_segments;
CREATE POLICY fanout_invoicing_backfill_segments ON subscriber_backfill_segments TO fanout_invoicing
    USING (subscriber = 'invoicing') WITH CHECK (subscriber = 'invoicing');
GRANT SELECT, INSERT, UPDATE, DELETE ON subscriber_backfill_failures TO fanout_invoicing;
DROP POLICY IF EXISTS fanout_invoicing_backfill_failures ON subscriber_backfill_failures;
CREATE POLICY fanout_invoicing_backfill_failures ON subscriber_backfill_failures TO fanout_invoicing
    USING (subscriber = 'invoicing') WITH CHECK (subscriber = 'invoicing');

-- Each subscriber's own grants (its declaration's Grants, and SELECT on
-- the table its backfill reads).
GRANT SELECT ON products, brands, categories, inventory TO fanout_cacheinval;
GRANT SELECT, INSERT, UPDATE ON fulfilment_orders TO fanout_fulfilment;
GRANT SELECT, INSERT ON fulfilment_history, fulfilment_violations TO fanout_fulfilment;
GRANT SELECT ON orders, order_lines, products TO fanout_invoicing;
GRANT INSERT ON invoices, invoice_lines TO fanout_invoicing;
GRANT SELECT (id, order_id) ON invoices TO fanout_invoicing;
GRANT USAGE ON SEQUENCE invoice_number_seq TO fanout_invoicing;
GRANT SELECT ON orders TO fanout_invoicing;
GRANT SELECT ON orders, order_lines TO fanout_salesledger;
GRANT SELECT, INSERT, UPDATE ON product_sales TO fanout_salesledger;
GRANT SELECT ON products, brands, categories, inventory TO fanout_searchindex;

-- The operator commands (besides what they do as the subscribers).
GRANT SELECT ON outbox TO fanout_operator;
GRANT UPDATE (status, attempts, last_error, available_at, claimed_at, lease_token, published_at)
    ON outbox TO fanout_operator;
-- The audit trail: read it, and add to it only through the function that
-- records the session's role (and checks what it records).
GRANT SELECT ON dead_letter_actions TO fanout_operator;
GRANT EXECUTE ON FUNCTION fanout_dead_letter_action(text, text, bigint, bigint, bigint, text, text, bigint) TO fanout_operator;
GRANT SELECT ON dead_letters TO fanout_operator;
-- Replays: requested, through the function that records the session's
-- role; the subscriber carries each out.
GRANT SELECT ON replays TO fanout_operator;
GRANT EXECUTE ON FUNCTION fanout_replay_request(text, text, bigint, interval, text), fanout_replay_outcome(bigint) TO fanout_operator;
-- Another database whose relays share the stream: registered through the
-- function that records the session's role (migration 00024).
GRANT EXECUTE ON FUNCTION fanout_origin_allow(text, text, text) TO fanout_operator;
GRANT SELECT ON origin_databases TO fanout_operator;
-- Which role may write which event types: declared and withdrawn through
-- the functions that record the session's role (migration 00026).
GRANT EXECUTE ON FUNCTION fanout_outbox_allow_writer(text, text, text), fanout_outbox_withdraw_writer(text, text) TO fanout_operator;
GRANT SELECT ON outbox_writer_types TO fanout_operator;
DROP POLICY IF EXISTS fanout_operator_dead_letters ON dead_letters;
CREATE POLICY fanout_operator_dead_letters ON dead_letters FOR SELECT TO fanout_operator USING (true);
GRANT SELECT ON relay_capture TO fanout_operator;
GRANT SELECT ON outbox_partitions, outbox_default, outbox_epochs, event_origins, outbox_audits, outbox_audit_state TO fanout_operator;
-- fanout status counts the ordered subscribers' held aggregates (releasing
-- one, at a discard, it does as the subscriber).
GRANT SELECT ON subscriber_aggregates TO fanout_operator;
DROP POLICY IF EXISTS fanout_operator_aggregates ON subscriber_aggregates;
CREATE POLICY fanout_operator_aggregates ON subscriber_aggregates FOR SELECT TO fanout_operator USING (true);
-- fanout status shows the backfills.
GRANT SELECT ON subscriber_backfills, subscriber_backfill_segments, subscriber_backfill_failures TO fanout_operator;
DROP POLICY IF EXISTS fanout_operator_backfill_segments ON subscriber_backfill_segments;
CREATE POLICY fanout_operator_backfill_segments ON subscriber_backfill_segments FOR SELECT TO fanout_operator USING (true);
DROP POLICY IF EXISTS fanout_operator_backfills ON subscriber_backfills;
CREATE POLICY fanout_operator_backfills ON subscriber_backfills FOR SELECT TO fanout_operator USING (true);
DROP POLICY IF EXISTS fanout_operator_backfill_failures ON subscriber_backfill_failures;
CREATE POLICY fanout_operator_backfill_failures ON subscriber_backfill_failures FOR SELECT TO fanout_operator USING (true);
-- outbox skip marks a failed row skipped (the status column, above).

\else
\echo 'roles.sql: fanout''s tables are not all there yet: roles, CONNECT and schema privileges done; run `fanout migrate` as fanout_migrate, then this file again for the table grants'
\endif

COMMIT;
