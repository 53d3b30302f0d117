-- The relay's functions check what they are told against what the
-- database knows (issue 47, items 4 and 5). Called as the relay's role
-- with made-up arguments, fanout_outbox_new_epoch began an epoch at id 1
-- and gave every published event a second identity (the audit published
-- them again, and the sales ledger counted them twice), and
-- fanout_outbox_retire, told the capture was the slot's, confirmed past
-- everything and with no backlog, dropped a range with rows never
-- published.
--
-- Now a new epoch begins after every event recorded as published (a
-- landing, or a row's published_at), and a retirement takes the slot's
-- confirmed position and the backlog bound from the database (a wal
-- relay's slot must exist), and counts a pending row as the slot's only
-- with a landing. Retention and the audit's requirement are still the
-- caller's word.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_new_epoch(p_after integer, p_epoch integer, p_first_id bigint, p_past bigint, p_reason text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    latest integer;
    latest_first bigint;
    last bigint;
BEGIN
    LOCK TABLE public.outbox_epochs IN EXCLUSIVE MODE;
    SELECT epoch, first_id INTO latest, latest_first FROM public.outbox_epochs ORDER BY epoch DESC LIMIT 1;
    IF latest <> p_after THEN
        RETURN latest;
    END IF;
    IF p_epoch <= latest THEN
        RAISE EXCEPTION 'epoch % is not after the latest, %', p_epoch, latest;
    END IF;
    IF p_first_id <= latest_first THEN
        RAISE EXCEPTION 'epoch % would begin at id %, not after epoch %''s first id %', p_epoch, p_first_id, latest, latest_first;
    END IF;
    -- Events published from p_first_id on would get a second identity,
    -- and the audit would publish them again under it: a restored
    -- database's new epoch begins after everything it recorded as
    -- published.
    IF EXISTS (SELECT FROM public.outbox_landings WHERE last_id >= p_first_id)
       OR EXISTS (SELECT FROM public.outbox WHERE id >= p_first_id AND published_at IS NOT NULL) THEN
        RAISE EXCEPTION 'epoch % would begin at id %, but events from there on were published already: they would be given a second identity', p_epoch, p_first_id;
    END IF;
    last := public.fanout_outbox_last_id();
    IF p_first_id > last + 1 THEN
        RAISE EXCEPTION 'epoch % would begin at id %, past the next id %', p_epoch, p_first_id, last + 1;
    END IF;
    IF p_past IS NOT NULL AND (p_past < 0 OR p_past >= 281474976710656) THEN
        RAISE EXCEPTION 'the ids cannot move to %: the past of a restore lies between 0 and 2^48', p_past;
    END IF;
    IF p_reason IS NULL OR btrim(p_reason) = '' THEN
        RAISE EXCEPTION 'a new outbox epoch needs a reason';
    END IF;
    INSERT INTO public.outbox_epochs (epoch, first_id, reason) VALUES (p_epoch, p_first_id, p_reason);
    IF p_past IS NOT NULL AND p_past > last THEN
        PERFORM setval(pg_get_serial_sequence('public.outbox', 'id'), p_past);
    END IF;
    RETURN p_epoch;
END
$$;
-- +goose StatementEnd

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
    audited_from bigint;
BEGIN
    retired := false;
    moved := 0;
    -- What the caller says of the capture is checked against what the
    -- database has: the slot's own confirmed position and the recorded
    -- backlog bound, and a wal relay's slot must exist for its rows to
    -- count as decoded. The arguments stay for the callers' sake.
    SELECT bool_or(s.slot_name IS NOT NULL), min(s.confirmed_flush_lsn),
           max(c.backlog_through) FILTER (WHERE c.backlog_done_at IS NULL)
    INTO captured, confirmed, backlog_through
    FROM relay_capture c
    LEFT JOIN pg_replication_slots s ON s.slot_name = c.slot_name AND s.database = current_database()
    WHERE captured;
    captured := coalesce(captured, false);
    SELECT from_id INTO audited_from FROM outbox_audit_state;
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
        -- A row the slot decoded stays pending: it counts as published
        -- only with a landing (recorded before the slot may be confirmed
        -- past it), unless it is older than the landings.
        EXECUTE format($q$
            WITH landed AS (
                SELECT DISTINCT e.id
                FROM outbox_landings l, unnest(l.event_ids) AS e(id)
                WHERE l.last_id >= %s AND l.first_id < %s
            )
            SELECT count(*) FILTER (WHERE o.published_at IS NULL AND o.status IN ('pending', 'sending')
                                      AND (o.id <= %s OR (o.id >= %s AND landed.id IS NULL))),
                   greatest(max(o.available_at) FILTER (WHERE o.published_at IS NULL AND o.status = 'pending'),
                            max(o.published_at), %L::timestamptz)
            FROM %I o LEFT JOIN landed ON landed.id = o.id$q$,
            coalesce(p.lower_id, -9223372036854775808), p.upper_id,
            coalesce(backlog_through, -9223372036854775808), coalesce(audited_from, 0), p.done_at, part)
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
CREATE OR REPLACE FUNCTION fanout_outbox_new_epoch(p_after integer, p_epoch integer, p_first_id bigint, p_past bigint, p_reason text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    latest integer;
    latest_first bigint;
    last bigint;
BEGIN
    LOCK TABLE public.outbox_epochs IN EXCLUSIVE MODE;
    SELECT epoch, first_id INTO latest, latest_first FROM public.outbox_epochs ORDER BY epoch DESC LIMIT 1;
    IF latest <> p_after THEN
        RETURN latest;
    END IF;
    IF p_epoch <= latest THEN
        RAISE EXCEPTION 'epoch % is not after the latest, %', p_epoch, latest;
    END IF;
    IF p_first_id <= latest_first THEN
        RAISE EXCEPTION 'epoch % would begin at id %, not after epoch %''s first id %', p_epoch, p_first_id, latest, latest_first;
    END IF;
    last := public.fanout_outbox_last_id();
    IF p_first_id > last + 1 THEN
        RAISE EXCEPTION 'epoch % would begin at id %, past the next id %', p_epoch, p_first_id, last + 1;
    END IF;
    IF p_past IS NOT NULL AND (p_past < 0 OR p_past >= 281474976710656) THEN
        RAISE EXCEPTION 'the ids cannot move to %: the past of a restore lies between 0 and 2^48', p_past;
    END IF;
    IF p_reason IS NULL OR btrim(p_reason) = '' THEN
        RAISE EXCEPTION 'a new outbox epoch needs a reason';
    END IF;
    INSERT INTO public.outbox_epochs (epoch, first_id, reason) VALUES (p_epoch, p_first_id, p_reason);
    IF p_past IS NOT NULL AND p_past > last THEN
        PERFORM setval(pg_get_serial_sequence('public.outbox', 'id'), p_past);
    END IF;
    RETURN p_epoch;
END
$$;
-- +goose StatementEnd

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
