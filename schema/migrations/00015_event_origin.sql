-- Every event knows the database it came from (DESIGN.md, invariant 10).
--
-- An event's identity is its origin and its outbox id. The origin is
-- "<system identifier>/<database>/<epoch>": the cluster's system
-- identifier and the database's name, read live (pg_control_system(),
-- current_database()), so that a copy of the database (CREATE DATABASE
-- ... TEMPLATE, pg_dump into another cluster) is another origin; and the
-- outbox epoch, from this table. The relay carries the origin in the
-- Fanout-Origin header and in Nats-Msg-Id ("<origin>:<id>"), so JetStream
-- never drops one database's event as a duplicate of another's, and the
-- subscribers' checkpoints key on it.
--
-- Epochs: a restore from a backup rewinds the outbox's ids, and the
-- database then hands out again ids the stream already holds events for.
-- The relay detects it (package relay, origin.go) and begins a new epoch
-- at the first id the restored database wrote: rows from there on are
-- events of the new epoch, distinct from the lost ones with the same ids.
-- A row's epoch is the one with the greatest first_id at or below its id.

-- +goose Up
CREATE TABLE outbox_epochs (
    epoch    integer     PRIMARY KEY CHECK (epoch >= 1),
    first_id bigint      NOT NULL UNIQUE,
    began_at timestamptz NOT NULL DEFAULT now(),
    reason   text        NOT NULL
);
INSERT INTO outbox_epochs (epoch, first_id, reason)
VALUES (1, -9223372036854775808, 'the outbox''s first epoch (migration 00015)');

-- +goose StatementBegin
-- fanout_outbox_last_id is the last id the outbox handed out (0 before the
-- first): what a restore rewinds. The relay compares it with the events
-- the stream holds. It reads the sequence itself: pg_sequence_last_value
-- is NULL after ALTER ... RESTART (is_called false), which would read as 0.
CREATE FUNCTION fanout_outbox_last_id() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    last bigint;
    called boolean;
BEGIN
    EXECUTE format('SELECT last_value, is_called FROM %s', pg_get_serial_sequence('public.outbox', 'id')::regclass)
        INTO last, called;
    RETURN CASE WHEN called THEN last ELSE last - 1 END;
END
$$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION fanout_outbox_last_id() FROM PUBLIC;

-- +goose StatementBegin
-- fanout_outbox_state is the outbox's last id and its epochs, read
-- together under a lock that waits for an epoch being begun: a relay that
-- reads the id sequence after another relay moved it past a restore's lost
-- ids also sees the epoch that move belongs to (setval takes effect at
-- once, the epoch's row at its commit).
CREATE FUNCTION fanout_outbox_state(OUT last_id bigint, OUT epochs jsonb)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    LOCK TABLE public.outbox_epochs IN SHARE MODE;
    last_id := public.fanout_outbox_last_id();
    SELECT jsonb_agg(jsonb_build_object('epoch', epoch, 'first_id', first_id) ORDER BY first_id)
    INTO epochs FROM public.outbox_epochs;
END
$$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION fanout_outbox_state() FROM PUBLIC;

-- +goose StatementBegin
-- fanout_outbox_new_epoch begins epoch p_epoch (above p_after) at
-- p_first_id, unless another relay already began a later epoch than
-- p_after (it then returns the latest epoch and changes nothing): relays
-- that see the same rewind at once begin one epoch. p_epoch skips numbers
-- when the stream holds events of an epoch the restored database lost.
-- The outbox id sequence moves to at least p_past, so new rows take ids
-- the stream has no event for; it never moves back. The bounds keep a
-- relay's role from relabelling rows it could not have seen (a first id
-- past the next one) or from running the ids out (p_past below 2^48, the
-- room the subscribers' checkpoint keys leave every origin).
CREATE FUNCTION fanout_outbox_new_epoch(p_after integer, p_epoch integer, p_first_id bigint, p_past bigint, p_reason text)
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
REVOKE EXECUTE ON FUNCTION fanout_outbox_new_epoch(integer, integer, bigint, bigint, text) FROM PUBLIC;

-- Checkpoints key on the full identity. A subscriber's checkpoint key is
-- the event id for events of its own database's first epoch (every event
-- before this migration, and nearly every one after), so processed_events
-- and the other tables keyed on event_id keep their rows. Any other origin
-- gets a number here, and its events the key number * 2^48 + id.
CREATE TABLE event_origins (
    num     integer GENERATED ALWAYS AS IDENTITY (START WITH 1 MAXVALUE 32767) PRIMARY KEY,
    origin  text        NOT NULL UNIQUE,
    seen_at timestamptz NOT NULL DEFAULT now()
);

-- +goose StatementBegin
-- fanout_origin_number numbers an origin, once: the subscribers' roles
-- number origins through it and may not insert into event_origins
-- themselves, so that only what reads as an origin takes one of its 32767
-- numbers. NULL when they are all taken (the event is then dead-lettered,
-- with the reason).
CREATE FUNCTION fanout_origin_number(p_origin text) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    IF p_origin IS NULL OR p_origin !~ '^[0-9]{1,20}/[^/]+/[1-9][0-9]{0,9}$' OR length(p_origin) > 200 THEN
        RAISE EXCEPTION 'not an origin: %', left(p_origin, 200) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT num INTO n FROM public.event_origins WHERE origin = p_origin;
    IF n IS NOT NULL THEN
        RETURN n;
    END IF;
    BEGIN
        INSERT INTO public.event_origins (origin) VALUES (p_origin) ON CONFLICT (origin) DO NOTHING RETURNING num INTO n;
    EXCEPTION WHEN sequence_generator_limit_exceeded THEN
        RETURN NULL;
    END;
    IF n IS NULL THEN
        SELECT num INTO n FROM public.event_origins WHERE origin = p_origin;
    END IF;
    RETURN n;
END
$$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION fanout_origin_number(text) FROM PUBLIC;

-- +goose Down
DROP FUNCTION fanout_origin_number(text);
DROP TABLE event_origins;
DROP FUNCTION fanout_outbox_new_epoch(integer, integer, bigint, bigint, text);
DROP FUNCTION fanout_outbox_state();
DROP FUNCTION fanout_outbox_last_id();
DROP TABLE outbox_epochs;
