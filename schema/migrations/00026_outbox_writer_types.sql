-- Each writer writes its own event types (issue 47). Any role granted
-- fanout_writer could write any event type: a catalog application's
-- credentials could commit order.created, and every subscriber would
-- take it for an order. Now an event is written only by a login role a
-- declaration names for its type (outbox_writer_types, made with `fanout
-- outbox writers allow`), checked by Postgres at the insert: a writer
-- cannot name another role, and SET ROLE does not change whose the
-- session is.
--
-- A declaration's writer is a role: the application's login role, or a
-- group role its members write as (fanout_writer for all of them); its
-- event type is one type, or '*' for every type. The migration declares
-- fanout_writer for '*' so that writers keep working as before: declare
-- each application's types, then withdraw that one.
--
-- The check runs for the rows a writer inserts (status pending, the only
-- one a writer can give). The outbox owner's session passes (it may drop
-- the check anyway: a development setup writes as the owner), and so does
-- a superuser's; the relay's retirement moves failed rows, which are not
-- checked again.

-- +goose Up
CREATE TABLE outbox_writer_types (
    writer      name        NOT NULL CHECK (writer <> ''),
    event_type  text        NOT NULL CHECK (event_type <> ''),
    declared_at timestamptz NOT NULL DEFAULT now(),
    declared_by text        NOT NULL DEFAULT session_user,
    reason      text        NOT NULL CHECK (btrim(reason) <> ''),
    PRIMARY KEY (writer, event_type)
);
INSERT INTO outbox_writer_types (writer, event_type, reason)
VALUES ('fanout_writer', '*', 'every writer, as before migration 26: declare each application''s event types, then withdraw this');

-- +goose StatementBegin
CREATE FUNCTION fanout_outbox_check_writer() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- The outbox's owner (whose this function is: current_user) and a
    -- superuser may do anything to it anyway; a development setup writes
    -- as the owner.
    IF pg_has_role(session_user, current_user, 'MEMBER') THEN
        RETURN NEW;
    END IF;
    -- A declaration whose role was dropped since (to_regrole: NULL) lets
    -- nobody write.
    IF NOT EXISTS (SELECT FROM public.outbox_writer_types w
                   WHERE w.event_type IN (NEW.event_type, '*')
                     AND pg_has_role(session_user, to_regrole(w.writer::text), 'MEMBER')) THEN
        RAISE EXCEPTION 'role % may not write events of type % (fanout outbox writers allow)', session_user, left(NEW.event_type, 200)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END $$;
-- +goose StatementEnd

-- Named to fire before outbox_sequence (triggers fire in name order): a
-- refused event takes no number.
CREATE TRIGGER outbox_check_writer BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.status = 'pending') EXECUTE FUNCTION fanout_outbox_check_writer();

-- +goose StatementBegin
-- fanout_outbox_allow_writer lets writer (a role) write event_type ('*':
-- every type); true if the declaration is new. The operator's `fanout
-- outbox writers allow`; recorded with the session's role.
CREATE FUNCTION fanout_outbox_allow_writer(p_writer text, p_event_type text, p_reason text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    added boolean;
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = p_writer) THEN
        RAISE EXCEPTION 'no role %', p_writer USING ERRCODE = 'undefined_object';
    END IF;
    INSERT INTO public.outbox_writer_types (writer, event_type, reason, declared_by)
    VALUES (p_writer, p_event_type, p_reason, session_user)
    ON CONFLICT DO NOTHING
    RETURNING true INTO added;
    RETURN coalesce(added, false);
END $$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION fanout_outbox_allow_writer(text, text, text) FROM PUBLIC;

-- +goose StatementBegin
-- fanout_outbox_withdraw_writer takes a declaration back; true if there
-- was one.
CREATE FUNCTION fanout_outbox_withdraw_writer(p_writer text, p_event_type text) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH gone AS (DELETE FROM public.outbox_writer_types WHERE writer = p_writer AND event_type = p_event_type RETURNING 1)
    SELECT count(*) > 0 FROM gone
$$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION fanout_outbox_withdraw_writer(text, text) FROM PUBLIC;

-- +goose Down
DROP FUNCTION fanout_outbox_withdraw_writer(text, text);
DROP FUNCTION fanout_outbox_allow_writer(text, text, text);
DROP TRIGGER outbox_check_writer ON outbox;
DROP FUNCTION fanout_outbox_check_writer();
DROP TABLE outbox_writer_types;
