-- Per-aggregate order (DESIGN.md, invariant 8). Within one aggregate
-- (aggregate_type, aggregate_id), events are numbered 1, 2, 3, ... in the
-- order their writers' transactions commit, by the database itself, so a
-- writer in any language gets it with a plain INSERT:
--
-- A BEFORE INSERT trigger takes the aggregate's counter row in
-- outbox_aggregates (an upsert, which locks it) and gives the row the next
-- number, aggregate_seq. The lock is held to the writer's commit, so a
-- second transaction writing an event of the same aggregate waits for the
-- first to commit or roll back: numbers follow commit order, and a
-- rolled-back transaction gives its number back (the counter's update is
-- rolled back with it), so an aggregate's numbers have no gaps. Outbox ids
-- give neither: an id is taken before the lock, and two transactions on
-- one aggregate may commit in the other order.
--
-- What it costs: transactions writing events of the same aggregate
-- serialize from the event's insert to their commit (most already do, on
-- the aggregate's own row), and two transactions writing events of the
-- same two aggregates in opposite orders can deadlock (PostgreSQL aborts
-- one; write a transaction's events in a stable order, or retry). One
-- counter row per aggregate is kept for good.
--
-- A row given a number by its writer keeps it (fanout_writer may not set
-- the column; the relay's retention moves failed rows with theirs).

-- +goose Up
CREATE TABLE outbox_aggregates (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);
-- Every event updates its aggregate's row: room for HOT updates.
ALTER TABLE outbox_aggregates SET (fillfactor = 70);

ALTER TABLE outbox ADD COLUMN aggregate_seq bigint;

-- +goose StatementBegin
CREATE FUNCTION fanout_outbox_sequence() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
AS $$
BEGIN
    IF NEW.aggregate_seq IS NULL THEN
        INSERT INTO outbox_aggregates AS a (aggregate_type, aggregate_id, last_seq)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = a.last_seq + 1
        RETURNING a.last_seq INTO NEW.aggregate_seq;
    END IF;
    RETURN NEW;
END $$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_outbox_sequence() FROM PUBLIC;

CREATE TRIGGER outbox_sequence BEFORE INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION fanout_outbox_sequence();

-- The relay's ordered claim (package relay): a row is claimed only when no
-- earlier event of its aggregate is still unpublished. Unsent rows only,
-- like outbox_unsent_idx; sent rows leave it.
CREATE INDEX outbox_aggregate_unsent_idx ON outbox (aggregate_type, aggregate_id, aggregate_seq)
    WHERE published_at IS NULL;

-- A failed row may hold its aggregate's later events (relay.on_failed
-- hold); an operator who gives up on it marks it skipped (fanout outbox
-- skip), which holds nothing and is never published. The ranges carry
-- copies of the constraint (each was created LIKE outbox): each goes.
ALTER TABLE outbox DROP CONSTRAINT outbox_status_check;
-- +goose StatementBegin
DO $$
DECLARE
    rel regclass;
BEGIN
    FOR rel IN SELECT conrelid::regclass FROM pg_constraint WHERE conname = 'outbox_status_check' LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT outbox_status_check', rel);
    END LOOP;
END $$;
-- +goose StatementEnd
ALTER TABLE outbox ADD CONSTRAINT outbox_status_check
    CHECK (status IN ('pending', 'sending', 'sent', 'failed', 'skipped'));

-- Retention moves a dropped range's failed rows to outbox_default: now
-- with their numbers.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_retire(part text, retention interval, captured boolean, confirmed pg_lsn, backlog_through bigint,
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
               available_at, claimed_at, lease_token, created_at, published_at, aggregate_seq
        FROM %I WHERE published_at IS NULL AND status = 'failed'$q$, part);
    GET DIAGNOSTICS moved = ROW_COUNT;
    EXECUTE format('DROP TABLE %I', part);
    DELETE FROM outbox_partitions WHERE name = part;
    retired := true;
END $$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_retire(part text, retention interval, captured boolean, confirmed pg_lsn, backlog_through bigint,
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
UPDATE outbox SET status = 'failed' WHERE status = 'skipped';
ALTER TABLE outbox DROP CONSTRAINT outbox_status_check;
-- +goose StatementBegin
DO $$
DECLARE
    rel regclass;
BEGIN
    FOR rel IN SELECT conrelid::regclass FROM pg_constraint WHERE conname = 'outbox_status_check' LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT outbox_status_check', rel);
    END LOOP;
END $$;
-- +goose StatementEnd
ALTER TABLE outbox ADD CONSTRAINT outbox_status_check
    CHECK (status IN ('pending', 'sending', 'sent', 'failed'));
DROP INDEX outbox_aggregate_unsent_idx;
DROP TRIGGER outbox_sequence ON outbox;
DROP FUNCTION fanout_outbox_sequence();
ALTER TABLE outbox DROP COLUMN aggregate_seq;
DROP TABLE outbox_aggregates;
