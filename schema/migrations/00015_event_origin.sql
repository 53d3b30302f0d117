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
-- the stream holds.
CREATE FUNCTION fanout_outbox_last_id() RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
    SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('public.outbox', 'id')::regclass), 0)
$$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION fanout_outbox_last_id() FROM PUBLIC;

-- +goose StatementBegin
-- fanout_outbox_new_epoch begins epoch p_epoch (above p_after) at
-- p_first_id, unless another relay already began a later epoch than
-- p_after (it then returns the latest epoch and changes nothing): relays
-- that see the same rewind at once begin one epoch. p_epoch skips numbers
-- when the stream holds events of an epoch the restored database lost.
-- The outbox id sequence moves to at least p_past, so new rows take ids
-- the stream has no event for.
CREATE FUNCTION fanout_outbox_new_epoch(p_after integer, p_epoch integer, p_first_id bigint, p_past bigint, p_reason text)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    latest integer;
    latest_first bigint;
BEGIN
    LOCK TABLE outbox_epochs IN EXCLUSIVE MODE;
    SELECT epoch, first_id INTO latest, latest_first FROM outbox_epochs ORDER BY epoch DESC LIMIT 1;
    IF latest <> p_after THEN
        RETURN latest;
    END IF;
    IF p_epoch <= latest THEN
        RAISE EXCEPTION 'epoch % is not after the latest, %', p_epoch, latest;
    END IF;
    IF p_first_id <= latest_first THEN
        RAISE EXCEPTION 'epoch % would begin at id %, not after epoch %''s first id %', p_epoch, p_first_id, latest, latest_first;
    END IF;
    IF p_reason IS NULL OR btrim(p_reason) = '' THEN
        RAISE EXCEPTION 'a new outbox epoch needs a reason';
    END IF;
    INSERT INTO outbox_epochs (epoch, first_id, reason) VALUES (p_epoch, p_first_id, p_reason);
    IF p_past IS NOT NULL THEN
        PERFORM setval(pg_get_serial_sequence('public.outbox', 'id'), greatest(p_past, fanout_outbox_last_id()));
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

-- +goose Down
DROP TABLE event_origins;
DROP FUNCTION fanout_outbox_new_epoch(integer, integer, bigint, bigint, text);
DROP FUNCTION fanout_outbox_last_id();
DROP TABLE outbox_epochs;
