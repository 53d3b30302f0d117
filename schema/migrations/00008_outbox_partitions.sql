-- The outbox becomes a table partitioned by ranges of ids, so that the
-- relays remove old events by dropping whole ranges rather than deleting
-- rows one by one (package relay, "Retention"). A wal relay never touches
-- the rows it publishes; with this, its outbox is an append-only log whose
-- retention writes nothing per row.
--
-- Ranges by id, not by time: the id stays the primary key and the
-- Nats-Msg-Id, lookups by id prune to one range, and ids grow with time.
-- The relays add ranges ahead of the identity (fanout_outbox_extend) and
-- drop ranges past retention (fanout_outbox_seal, fanout_outbox_retire).
-- Rows whose range does not exist (relays stopped for long, ids given by
-- hand) land in outbox_default, so a writer never fails for want of a
-- range; the relays delete those one by one, as before.
--
-- The existing table becomes the first range, outbox_legacy, ending at the
-- identity's next value (or is dropped if it is empty). Run this migration
-- with writers and relays stopped or willing to wait: it holds the outbox
-- locked while it rebuilds.
--
-- The range DDL runs in SECURITY DEFINER functions owned by the table's
-- owner: the relay's role owns nothing and may only call them
-- (deploy/postgres/roles.sql).

-- +goose Up
ALTER TABLE outbox RENAME TO outbox_legacy;
ALTER INDEX outbox_pkey RENAME TO outbox_legacy_pkey;
ALTER INDEX outbox_unsent_idx RENAME TO outbox_legacy_unsent_idx;

-- Every range the relays manage, and how far each is on its way out.
CREATE TABLE outbox_partitions (
    name       text        PRIMARY KEY,
    lower_id   bigint,               -- NULL: from the lowest bigint
    upper_id   bigint      NOT NULL, -- exclusive
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Set once every id of the range was handed out and no transaction
    -- still inserts into it; sealed_lsn is the WAL position then, past
    -- which a replication slot has decoded every row of the range.
    sealed_at  timestamptz,
    sealed_lsn pg_lsn,
    -- When every row of the range was last known published: retention
    -- counts from it.
    done_at    timestamptz
);

-- +goose StatementBegin
DO $$
DECLARE
    next_id bigint := coalesce(pg_sequence_last_value(pg_get_serial_sequence('outbox_legacy', 'id')::regclass), 0) + 1;
BEGIN
    ALTER TABLE outbox_legacy ALTER COLUMN id DROP IDENTITY;

    CREATE TABLE outbox (
        id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        aggregate_type text        NOT NULL,
        aggregate_id   text        NOT NULL,
        event_type     text        NOT NULL,
        payload        jsonb       NOT NULL,
        headers        jsonb       NOT NULL DEFAULT '{}',
        status         text        NOT NULL DEFAULT 'pending'
                       CONSTRAINT outbox_status_check
                       CHECK (status IN ('pending', 'sending', 'sent', 'failed')),
        attempts       integer     NOT NULL DEFAULT 0,
        last_error     text,
        available_at   timestamptz NOT NULL DEFAULT now(),
        claimed_at     timestamptz,
        lease_token    uuid,
        created_at     timestamptz NOT NULL DEFAULT now(),
        published_at   timestamptz
    ) PARTITION BY RANGE (id);
    -- As before (00001): a claim, retry or reap stays a HOT update.
    CREATE INDEX outbox_unsent_idx ON outbox (id) WHERE published_at IS NULL;
    EXECUTE format('ALTER TABLE outbox ALTER COLUMN id RESTART WITH %s', next_id);

    CREATE TABLE outbox_default PARTITION OF outbox DEFAULT WITH (fillfactor = 50);

    IF EXISTS (SELECT FROM outbox_legacy) THEN
        EXECUTE format('ALTER TABLE outbox ATTACH PARTITION outbox_legacy FOR VALUES FROM (MINVALUE) TO (%s)', next_id);
        INSERT INTO outbox_partitions (name, lower_id, upper_id) VALUES ('outbox_legacy', NULL, next_id);
    ELSE
        DROP TABLE outbox_legacy;
    END IF;
END $$;
-- +goose StatementEnd

ALTER PUBLICATION fanout_outbox SET TABLE outbox;
-- Changes of every range are decoded as changes of outbox itself.
ALTER PUBLICATION fanout_outbox SET (publish_via_partition_root = true);

-- fanout_outbox_extend keeps ranges of `span` ids up to `margin` + `ahead`
-- ranges beyond the next id, and returns the ranges it created; `margin`
-- is explained below. A new range is created as a plain
-- table with a CHECK of its bounds and then attached: ATTACH takes only a
-- SHARE UPDATE EXCLUSIVE lock on outbox (CREATE ... PARTITION OF would take
-- ACCESS EXCLUSIVE), and the CHECK spares it a scan.
--
-- A new range must start above every id a writer may hold while it is
-- attached. PostgreSQL routes a row by the partitions it saw when its
-- statement began and checks it against the partition's constraint once it
-- holds the partition's lock: a row routed to outbox_default just before
-- an ATTACH commits, with an id in the new range, fails its insert. So
-- outbox_default is locked first (ATTACH locks it anyway), and when the ids
-- have come within `margin` of the last range's end (the relays were
-- stopped, or this is the first range), the next range starts `margin`
-- above the next id, and the ids below it go to outbox_default. Writers
-- would have to take `margin` ids while the function runs (a few
-- milliseconds, and at most lock_timeout waiting for its locks) to reach
-- the new range.
-- +goose StatementBegin
CREATE FUNCTION fanout_outbox_extend(span bigint, ahead integer, margin bigint) RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '200ms'
AS $$
DECLARE
    next_id bigint;
    lo bigint;
    blocked_to bigint;
    part text;
BEGIN
    IF span < 1 OR ahead < 1 OR margin < 1 THEN
        RAISE EXCEPTION 'fanout_outbox_extend: span (%), ahead (%) and margin (%) must be positive', span, ahead, margin;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('fanout_outbox_partitions'));
    SELECT max(upper_id) INTO lo FROM outbox_partitions;
    next_id := coalesce(pg_sequence_last_value(pg_get_serial_sequence('public.outbox', 'id')::regclass), 0) + 1;
    IF lo >= next_id + margin + span * ahead THEN
        RETURN;
    END IF;
    LOCK TABLE outbox_default IN ACCESS EXCLUSIVE MODE;
    next_id := coalesce(pg_sequence_last_value(pg_get_serial_sequence('public.outbox', 'id')::regclass), 0) + 1;
    lo := greatest(lo, next_id + margin);
    WHILE lo < next_id + margin + span * ahead LOOP
        -- A row given its id by hand may sit in outbox_default where the
        -- range would go: ATTACH would refuse, so the range starts past it.
        SELECT max(id) + 1 INTO blocked_to FROM outbox_default WHERE id >= lo AND id < lo + span;
        IF blocked_to IS NOT NULL THEN
            lo := blocked_to;
            CONTINUE;
        END IF;
        part := format('outbox_%s', lo);
        EXECUTE format('CREATE TABLE %I (LIKE outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS) WITH (fillfactor = 50)', part);
        EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I CHECK (id >= %s AND id < %s)', part, part || '_bounds', lo, lo + span);
        EXECUTE format('ALTER TABLE outbox ATTACH PARTITION %I FOR VALUES FROM (%s) TO (%s)', part, lo, lo + span);
        EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I', part, part || '_bounds');
        INSERT INTO outbox_partitions (name, lower_id, upper_id) VALUES (part, lo, lo + span);
        RETURN NEXT part;
        lo := lo + span;
    END LOOP;
END $$;
-- +goose StatementEnd

-- fanout_outbox_seal marks a range sealed once every id in it was handed
-- out: the SHARE lock waits for the transactions still inserting into it,
-- so every row it will ever hold is committed, and in the WAL before
-- sealed_lsn. It returns whether it sealed the range.
-- +goose StatementBegin
CREATE FUNCTION fanout_outbox_seal(part text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '200ms'
AS $$
DECLARE
    next_id bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('fanout_outbox_partitions'));
    next_id := coalesce(pg_sequence_last_value(pg_get_serial_sequence('public.outbox', 'id')::regclass), 0) + 1;
    PERFORM FROM outbox_partitions WHERE name = part AND sealed_at IS NULL AND upper_id <= next_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    EXECUTE format('LOCK TABLE %I IN SHARE MODE', part);
    UPDATE outbox_partitions SET sealed_at = clock_timestamp(), sealed_lsn = pg_current_wal_lsn() WHERE name = part;
    RETURN true;
END $$;
-- +goose StatementEnd

-- fanout_outbox_retire drops a sealed range whose rows were all published
-- longer than `retention` ago, and says why not when it does not:
--   poll capture (captured false): no row in it is pending or sending, and
--     none was published within retention;
--   wal capture: the slot confirmed past sealed_lsn (`confirmed`) longer
--     than retention ago, no row at or below the slot's backlog bound
--     (`backlog_through`) is still to be claimed, and no row was returned
--     to the relays (retry-failed, republish) within retention.
-- done_at remembers when the range was last found complete, so that a
-- range is scanned again only once retention has passed since.
-- Failed rows are moved to outbox_default (their range no longer exists),
-- with their ids, for an operator; moved says how many. The DETACH takes
-- an ACCESS EXCLUSIVE lock on outbox: writers wait for it, at most
-- lock_timeout, and the relay tries again at its next pass.
-- +goose StatementBegin
CREATE FUNCTION fanout_outbox_retire(part text, retention interval, captured boolean, confirmed pg_lsn, backlog_through bigint,
                                     OUT retired boolean, OUT moved bigint, OUT reason text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '200ms'
AS $$
DECLARE
    p outbox_partitions;
    now_ts timestamptz := clock_timestamp();
    unsent bigint;
    last_done timestamptz;
BEGIN
    retired := false;
    moved := 0;
    PERFORM pg_advisory_xact_lock(hashtext('fanout_outbox_partitions'));
    SELECT * INTO p FROM outbox_partitions WHERE name = part;
    IF NOT FOUND THEN
        reason := 'no such range';
        RETURN;
    ELSIF p.sealed_at IS NULL THEN
        reason := 'not sealed';
        RETURN;
    ELSIF greatest(p.sealed_at, p.done_at) > now_ts - retention THEN
        reason := 'within retention';
        RETURN;
    END IF;
    IF captured THEN
        IF confirmed IS NULL OR confirmed < p.sealed_lsn THEN
            reason := 'the slot has not confirmed its rows';
            RETURN;
        ELSIF p.done_at IS NULL THEN
            UPDATE outbox_partitions SET done_at = now_ts WHERE name = part;
            reason := 'the slot has just confirmed its rows';
            RETURN;
        END IF;
    END IF;

    -- No row of the range may change while it is judged and dropped. SHARE
    -- lets readers through, and the claims' SELECT ... FOR UPDATE too:
    -- only an update of a row in this range would wait for the scan.
    EXECUTE format('LOCK TABLE %I IN SHARE MODE', part);
    IF captured THEN
        EXECUTE format($q$
            SELECT count(*) FILTER (WHERE published_at IS NULL AND status IN ('pending', 'sending') AND id <= %s),
                   greatest(max(available_at) FILTER (WHERE published_at IS NULL AND status = 'pending'),
                            max(published_at), %L::timestamptz)
            FROM %I$q$, backlog_through, p.done_at, part)
        INTO unsent, last_done;
    ELSE
        EXECUTE format($q$
            SELECT count(*) FILTER (WHERE published_at IS NULL AND status IN ('pending', 'sending')), max(published_at)
            FROM %I$q$, part)
        INTO unsent, last_done;
    END IF;
    IF unsent > 0 THEN
        reason := format('%s rows not yet published', unsent);
        RETURN;
    END IF;
    last_done := coalesce(last_done, p.sealed_at);
    IF last_done > now_ts - retention THEN
        UPDATE outbox_partitions SET done_at = last_done WHERE name = part;
        reason := 'rows published within retention';
        RETURN;
    END IF;

    EXECUTE format('ALTER TABLE outbox DETACH PARTITION %I', part);
    EXECUTE format($q$
        INSERT INTO outbox OVERRIDING SYSTEM VALUE
        SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, status, attempts, last_error,
               available_at, claimed_at, lease_token, created_at, published_at
        FROM %I WHERE published_at IS NULL AND status = 'failed'$q$, part);
    GET DIAGNOSTICS moved = ROW_COUNT;
    EXECUTE format('DROP TABLE %I', part);
    DELETE FROM outbox_partitions WHERE name = part;
    retired := true;
END $$;
-- +goose StatementEnd

REVOKE ALL ON FUNCTION fanout_outbox_extend(bigint, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION fanout_outbox_seal(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION fanout_outbox_retire(text, interval, boolean, pg_lsn, bigint) FROM PUBLIC;

-- +goose Down
DROP FUNCTION fanout_outbox_retire(text, interval, boolean, pg_lsn, bigint);
DROP FUNCTION fanout_outbox_seal(text);
DROP FUNCTION fanout_outbox_extend(bigint, integer, bigint);
-- Back to one table: the ranges' rows move into it, ids and all.
ALTER TABLE outbox RENAME TO outbox_partitioned;
ALTER INDEX outbox_pkey RENAME TO outbox_partitioned_pkey;
ALTER INDEX outbox_unsent_idx RENAME TO outbox_partitioned_unsent_idx;
CREATE TABLE outbox (LIKE outbox_partitioned INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE outbox ADD PRIMARY KEY (id);
ALTER TABLE outbox ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY;
INSERT INTO outbox OVERRIDING SYSTEM VALUE SELECT * FROM outbox_partitioned;
SELECT setval(pg_get_serial_sequence('outbox', 'id'), greatest(coalesce(pg_sequence_last_value(pg_get_serial_sequence('outbox_partitioned', 'id')::regclass), 0), 1));
CREATE INDEX outbox_unsent_idx ON outbox (id) WHERE published_at IS NULL;
ALTER TABLE outbox SET (fillfactor = 50);
ALTER PUBLICATION fanout_outbox SET TABLE outbox;
ALTER PUBLICATION fanout_outbox SET (publish_via_partition_root = false);
DROP TABLE outbox_partitioned;
DROP TABLE outbox_partitions;
