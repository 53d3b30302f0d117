-- The writer's transaction in every outbox row, for relay.atomic
-- transaction in poll capture. A poll relay sees rows, not transactions,
-- and a row's xmin is the claim's once a relay has claimed it; so each
-- row records the transaction that inserted it (pg_current_xact_id(): the
-- top-level transaction, also from inside a savepoint). fanout_writer has
-- no grant on the column, so a writer cannot claim another transaction's
-- id. Rows from before this migration have none: each is a transaction of
-- its own.
--
-- Cost to writers, measured (pgbench, 8 clients, 3 rounds; docs/
-- benchmarks.md): the insert kept 66% of a writer's transactions per
-- second without the column, 67% with it and its default, 68% with the
-- index too: nothing measurable, so the column is not optional.
--
-- The index finds a transaction's rows, in id order, when a poll relay
-- claims it whole (outbox.ClaimTransactions).

-- +goose Up
ALTER TABLE outbox ADD COLUMN writer_xid xid8;
-- A default set after the column is added applies to new rows only: no
-- rewrite of the existing ones.
ALTER TABLE outbox ALTER COLUMN writer_xid SET DEFAULT pg_current_xact_id();
CREATE INDEX outbox_writer_xid_idx ON outbox (writer_xid, id);

-- As in 00017, and: a failed row moved back keeps its transaction.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_retire(part text, retention interval, captured boolean, confirmed pg_lsn, backlog_through bigint,
                                     require_audit boolean, OUT retired boolean, OUT moved bigint, OUT reason text)
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
    IF require_audit AND (p.audited_at IS NULL OR p.audited_at <= last_done) THEN
        -- The auditor finds the ranges waiting for it by audit_due.
        UPDATE outbox_partitions SET audit_due = last_done WHERE name = part;
        reason := 'not audited since its rows were published';
        RETURN;
    END IF;

    EXECUTE format('ALTER TABLE outbox DETACH PARTITION %I', part);
    EXECUTE format($q$
        INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, status, attempts, last_error,
         available_at, claimed_at, lease_token, created_at, published_at, aggregate_seq, writer_xid)
        OVERRIDING SYSTEM VALUE
        SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, status, attempts, last_error,
               available_at, claimed_at, lease_token, created_at, published_at, aggregate_seq, writer_xid
        FROM %I WHERE published_at IS NULL AND status = 'failed'$q$, part);
    GET DIAGNOSTICS moved = ROW_COUNT;
    EXECUTE format('DROP TABLE %I', part);
    DELETE FROM outbox_partitions WHERE name = part;
    -- The landings no row is left for (a landing may span two ranges, and
    -- rows of outbox_default: it goes with the last of them).
    DELETE FROM outbox_landings l
    WHERE l.last_id < p.upper_id
      AND NOT EXISTS (SELECT FROM outbox o WHERE o.id BETWEEN l.first_id AND l.last_id);
    retired := true;
END $$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_retire(part text, retention interval, captured boolean, confirmed pg_lsn, backlog_through bigint,
                                     require_audit boolean, OUT retired boolean, OUT moved bigint, OUT reason text)
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
    IF require_audit AND (p.audited_at IS NULL OR p.audited_at <= last_done) THEN
        -- The auditor finds the ranges waiting for it by audit_due.
        UPDATE outbox_partitions SET audit_due = last_done WHERE name = part;
        reason := 'not audited since its rows were published';
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
    -- The landings no row is left for (a landing may span two ranges, and
    -- rows of outbox_default: it goes with the last of them).
    DELETE FROM outbox_landings l
    WHERE l.last_id < p.upper_id
      AND NOT EXISTS (SELECT FROM outbox o WHERE o.id BETWEEN l.first_id AND l.last_id);
    retired := true;
END $$;
-- +goose StatementEnd
DROP INDEX outbox_writer_xid_idx;
ALTER TABLE outbox DROP COLUMN writer_xid;
