-- The stream answers to Postgres (DESIGN.md, invariant 11). A PubAck is not
-- proof that a message will still be in the stream tomorrow: JetStream
-- acknowledges before it syncs to disk (sync_interval, 2 minutes by
-- default), and a server that loses power, or a disk that loses its last
-- writes, loses events the relay has marked sent. The outbox keeps every
-- event for relay.sent_retention after its publish; these tables let the
-- relay's auditor check the stream against it and publish again what the
-- stream lost, before a range of the outbox is dropped.
--
-- outbox_landings: where each published event landed, one row per
-- published batch (ids and stream sequences side by side: a row per batch
-- costs the relay one insert per batch, in the transaction that marks it).
-- A PubAck that reports a duplicate carries the sequence of the copy the
-- stream already had, which is what is recorded. An event published again
-- (a republish, a repair) lands again; the newest landing of an id is the
-- one the audit checks.

-- +goose Up
CREATE TABLE outbox_landings (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream    text        NOT NULL,
    first_id  bigint      NOT NULL,
    last_id   bigint      NOT NULL,
    event_ids bigint[]    NOT NULL,
    seqs      bigint[]    NOT NULL,
    landed_at timestamptz NOT NULL DEFAULT now(),
    CHECK (cardinality(event_ids) = cardinality(seqs) AND first_id <= last_id)
);
-- The audit of a range, and its drop, find its landings by id.
CREATE INDEX outbox_landings_ids_idx ON outbox_landings (last_id, first_id);

-- The auditor's state: landings audited so far by the continuous audit
-- (tail_landing: every landing at or below it was checked once its
-- events were older than relay.audit_delay), and the first outbox id
-- whose publish is recorded (rows below it were published before this
-- migration and are not audited).
CREATE TABLE outbox_audit_state (
    one          boolean PRIMARY KEY DEFAULT true CHECK (one),
    tail_landing bigint  NOT NULL DEFAULT 0,
    from_id      bigint  NOT NULL
);
INSERT INTO outbox_audit_state (from_id)
SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('public.outbox', 'id')::regclass), 0) + 1;

-- Each audit: what it checked and what it found (fanout status shows the
-- newest; fanout_relay_audit_* count them).
CREATE TABLE outbox_audits (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind        text        NOT NULL,
    scope       text        NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz NOT NULL DEFAULT now(),
    checked     bigint      NOT NULL,
    missing     bigint      NOT NULL,
    repaired    bigint      NOT NULL,
    detail      text        NOT NULL DEFAULT ''
);
CREATE INDEX outbox_audits_finished_idx ON outbox_audits (finished_at);

-- A range is dropped only after an audit of it passed since its rows were
-- last published: audit_due is set by fanout_outbox_retire when a range is
-- kept for want of one (its rows' last publish), audited_at by the auditor
-- when an audit that began then passed.
ALTER TABLE outbox_partitions ADD COLUMN audited_at timestamptz;
ALTER TABLE outbox_partitions ADD COLUMN audit_due timestamptz;

DROP FUNCTION fanout_outbox_retire(text, interval, boolean, pg_lsn, bigint);
-- +goose StatementBegin
-- As in 00009, and: with require_audit, a range whose last audit is older
-- than its last publish is kept; a dropped range takes its landings with it.
CREATE FUNCTION fanout_outbox_retire(part text, retention interval, captured boolean, confirmed pg_lsn, backlog_through bigint,
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
REVOKE ALL ON FUNCTION fanout_outbox_retire(text, interval, boolean, pg_lsn, bigint, boolean) FROM PUBLIC;

-- +goose Down
DROP FUNCTION fanout_outbox_retire(text, interval, boolean, pg_lsn, bigint, boolean);
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
REVOKE ALL ON FUNCTION fanout_outbox_retire(text, interval, boolean, pg_lsn, bigint) FROM PUBLIC;
ALTER TABLE outbox_partitions DROP COLUMN audit_due;
ALTER TABLE outbox_partitions DROP COLUMN audited_at;
DROP TABLE outbox_audits;
DROP TABLE outbox_audit_state;
DROP TABLE outbox_landings;
