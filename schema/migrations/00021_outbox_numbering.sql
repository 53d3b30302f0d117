-- Event types the outbox does not number. Numbering (migration 00009)
-- is what ordered subscribers need; it costs each insert a call of the
-- trigger and an upsert of the aggregate's counter row, about 8 points of
-- a writer's transactions per second (bench:relay, writer cost). An event
-- type no ordered subscriber reads gains nothing from it.
--
-- fanout_outbox_numbering(skip) makes the outbox number every event
-- except those whose event_type is in skip (empty: every event, as
-- migration 00009 made it). The list is the trigger's WHEN condition, so
-- a skipped event never enters PL/pgSQL, and its arguments, which any
-- role can read in pg_trigger (an ordered subscriber refuses to start if
-- it reads a skipped type). The trigger is made again in one
-- transaction: writers wait for it (the outbox is locked; each wait for
-- a lock is bounded by lock_timeout, 200 ms, and the caller tries
-- again), none inserts between the two.
--
-- A skipped event has no aggregate_seq: the relays publish it without
-- Fanout-Aggregate-Seq and outside its aggregate's order, and
-- relay.on_failed hold does not hold behind it. Run as the outbox's owner
-- (fanout outbox numbering, with the migrate role's credentials).

-- +goose Up
-- A row inserted by anything but a writer (the relays' retention moves a
-- dropped range's failed rows back into the outbox, status failed) keeps
-- the number it has, or none: a failed event written while its type was
-- skipped must not be numbered at its move, after the events written
-- since. Writers may not set status: theirs is always pending.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_sequence() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
AS $$
BEGIN
    IF NEW.aggregate_seq IS NULL AND NEW.status = 'pending' THEN
        INSERT INTO outbox_aggregates AS a (aggregate_type, aggregate_id, last_seq)
        VALUES (NEW.aggregate_type, NEW.aggregate_id, 1)
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = a.last_seq + 1
        RETURNING a.last_seq INTO NEW.aggregate_seq;
    END IF;
    RETURN NEW;
END $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION fanout_outbox_numbering(skip text[]) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '200ms'
AS $$
DECLARE
    types text[];
BEGIN
    IF skip IS NULL THEN
        RAISE EXCEPTION 'fanout_outbox_numbering: skip is NULL; an empty array numbers every event type' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT coalesce(array_agg(DISTINCT t ORDER BY t), '{}') INTO types FROM unnest(skip) AS t;
    IF array_position(types, NULL) IS NOT NULL OR array_position(types, '') IS NOT NULL THEN
        RAISE EXCEPTION 'fanout_outbox_numbering: an event type is empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The relays add and drop ranges under this lock, and a range attached
    -- while the trigger is made again could keep the old one.
    PERFORM pg_advisory_xact_lock(hashtext('fanout_outbox_partitions'));
    -- The outbox and its ranges at once, before the trigger's DDL takes
    -- them one by one. A writer or relay holding a range may still
    -- deadlock with it, or hold it past lock_timeout: the caller tries
    -- again (outbox.Store.SetNumbering). Writers queue behind each wait
    -- for a lock, the parent's and each range's in turn: lock_timeout is
    -- short for that.
    LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE;
    DROP TRIGGER outbox_sequence ON outbox;
    IF cardinality(types) = 0 THEN
        CREATE TRIGGER outbox_sequence BEFORE INSERT ON outbox
            FOR EACH ROW EXECUTE FUNCTION fanout_outbox_sequence();
    ELSE
        EXECUTE format('CREATE TRIGGER outbox_sequence BEFORE INSERT ON outbox FOR EACH ROW '
                       'WHEN (NEW.event_type <> ALL (%L::text[])) EXECUTE FUNCTION fanout_outbox_sequence(%s)',
                       types, (SELECT string_agg(quote_literal(t), ', ') FROM unnest(types) AS t));
    END IF;
END $$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_outbox_numbering(text[]) FROM PUBLIC;

-- +goose Down
SELECT fanout_outbox_numbering('{}');
DROP FUNCTION fanout_outbox_numbering(text[]);
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_sequence() RETURNS trigger
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
