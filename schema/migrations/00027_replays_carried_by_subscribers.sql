-- A replay is carried out by the subscriber it moves, from a request
-- recorded here (issue 47, item 2). The operator's NATS credential could
-- reset any subscriber's consumer, and a reset sent by other means than
-- `fanout replay` was recorded nowhere: moved forward, it made the
-- subscriber skip events in silence. Now the operator holds no reset on
-- any subscriber's consumer; it records a request (who, why, from where,
-- until when), and an instance of that subscriber, which alone may reset
-- its own consumer, takes the request, moves its consumer and records
-- what came of it. No consumer moves without a row here that names the
-- role that asked.
--
-- A request and its outcome are rows of replays: the request's outcome is
-- 'requested', and the outcome's row names it in request_id (one at
-- most). A request not taken by lapses_at has lapsed: no instance takes
-- it later, so nothing moves long after the operator stopped waiting.

-- +goose Up
ALTER TABLE replays ADD COLUMN request_id bigint REFERENCES replays (id);
ALTER TABLE replays ADD COLUMN lapses_at timestamptz;
CREATE UNIQUE INDEX replays_one_outcome ON replays (request_id) WHERE request_id IS NOT NULL;

-- +goose StatementBegin
-- fanout_replay_request records the operator's request to move
-- p_subscriber's consumer on p_stream to p_from_seq, to be taken within
-- p_within; its id.
CREATE FUNCTION fanout_replay_request(p_subscriber text, p_stream text, p_from_seq bigint, p_within interval, p_comment text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    id bigint;
BEGIN
    IF p_from_seq < 1 THEN
        RAISE EXCEPTION 'a replay starts at stream sequence 1 or later, not %', p_from_seq USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_within <= interval '0' OR p_within > interval '1 day' THEN
        RAISE EXCEPTION 'a replay request is taken within more than 0 and at most a day, not %', p_within USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO public.replays (subscriber, stream, from_seq, outcome, actor, comment, lapses_at)
    VALUES (p_subscriber, p_stream, p_from_seq, 'requested', session_user, coalesce(p_comment, ''), clock_timestamp() + p_within)
    RETURNING replays.id INTO id;
    RETURN id;
END $$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_replay_request(text, text, bigint, interval, text) FROM PUBLIC;

-- +goose StatementBegin
-- fanout_replay_acts_for raises unless the session may act for subscriber
-- p_subscriber: its role (fanout_<name>, or a role that is a member of
-- it) but not the operator's (a member of every subscriber role, for
-- redrives: it asks for replays and must not record their outcome), the
-- owner of replays (a development setup runs everything as the owner) or
-- a superuser.
CREATE FUNCTION fanout_replay_acts_for(p_subscriber text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF pg_has_role(session_user, current_user, 'MEMBER') THEN
        RETURN;
    END IF;
    IF to_regrole('fanout_' || p_subscriber) IS NULL
       OR NOT pg_has_role(session_user, to_regrole('fanout_' || p_subscriber), 'MEMBER')
       OR (to_regrole('fanout_operator') IS NOT NULL AND pg_has_role(session_user, to_regrole('fanout_operator'), 'MEMBER')) THEN
        RAISE EXCEPTION 'role % does not act for subscriber %: only the subscriber carries out its replays', session_user, left(p_subscriber, 200)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END $$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_replay_acts_for(text) FROM PUBLIC;

-- +goose StatementBegin
-- fanout_replay_take returns p_subscriber's oldest request neither
-- carried out nor lapsed, locked until the caller's transaction ends
-- (another instance skips it): the caller moves its consumer, then
-- records the outcome with fanout_replay_finish in the same transaction.
-- The lapse is read from the clock, not the transaction's start, so that
-- once fanout_replay_outcome has said 'lapsed' nobody takes the request.
-- Both are checked again once the row is locked, in a statement of its
-- own (a snapshot of its own): an instance that finished the request
-- between this statement's snapshot and its lock took nothing from
-- Postgres's point of view (the lock does not re-check a row that was
-- only locked, not changed), and would carry it out a second time.
CREATE FUNCTION fanout_replay_take(p_subscriber text) RETURNS TABLE (id bigint, stream text, from_seq bigint, actor text, comment text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    rid bigint;
    after bigint := 0;
BEGIN
    PERFORM public.fanout_replay_acts_for(p_subscriber);
    LOOP
        SELECT r.id INTO rid FROM public.replays r
        WHERE r.subscriber = p_subscriber AND r.request_id IS NULL AND r.outcome = 'requested'
          AND r.id > after AND r.lapses_at > clock_timestamp()
          AND NOT EXISTS (SELECT FROM public.replays o WHERE o.request_id = r.id)
        ORDER BY r.id LIMIT 1
        FOR UPDATE OF r SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN;
        END IF;
        IF NOT EXISTS (SELECT FROM public.replays o WHERE o.request_id = rid)
           AND (SELECT r.lapses_at FROM public.replays r WHERE r.id = rid) > clock_timestamp() THEN
            RETURN QUERY SELECT r.id, r.stream, r.from_seq, r.actor, r.comment FROM public.replays r WHERE r.id = rid;
            RETURN;
        END IF;
        after := rid;
    END LOOP;
END $$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_replay_take(text) FROM PUBLIC;

-- +goose StatementBegin
-- fanout_replay_finish records what came of request p_request: 'moved',
-- or why not. Only the subscriber the request names records it, once.
CREATE FUNCTION fanout_replay_finish(p_request bigint, p_outcome text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    req public.replays;
BEGIN
    SELECT * INTO req FROM public.replays WHERE replays.id = p_request AND request_id IS NULL AND outcome = 'requested';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no replay request %', p_request USING ERRCODE = 'no_data_found';
    END IF;
    PERFORM public.fanout_replay_acts_for(req.subscriber);
    IF EXISTS (SELECT FROM public.replays o WHERE o.request_id = p_request) THEN
        RAISE EXCEPTION 'replay request % has its outcome already', p_request USING ERRCODE = 'unique_violation';
    END IF;
    IF p_outcome IS NULL OR p_outcome = 'requested' OR btrim(p_outcome) = '' THEN
        RAISE EXCEPTION 'a replay''s outcome is moved or why not, not %', coalesce(p_outcome, 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO public.replays (subscriber, stream, from_seq, outcome, actor, comment, request_id)
    VALUES (req.subscriber, req.stream, req.from_seq, left(p_outcome, 2000), session_user, req.comment, req.id);
END $$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_replay_finish(bigint, text) FROM PUBLIC;

-- +goose StatementBegin
-- fanout_replay_outcome is what became of request p_request: its
-- outcome's text, 'requested' while it may still be taken, or 'lapsed'.
-- It waits for an instance that holds the request to finish, so that
-- 'lapsed' is final.
CREATE FUNCTION fanout_replay_outcome(p_request bigint) RETURNS TABLE (outcome text, actor text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lapses timestamptz;
BEGIN
    SELECT r.lapses_at INTO lapses FROM public.replays r WHERE r.id = p_request AND r.request_id IS NULL AND r.outcome = 'requested' FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no replay request %', p_request USING ERRCODE = 'no_data_found';
    END IF;
    RETURN QUERY SELECT o.outcome, o.actor FROM public.replays o WHERE o.request_id = p_request;
    IF NOT FOUND THEN
        RETURN QUERY SELECT CASE WHEN lapses > clock_timestamp() THEN 'requested' ELSE 'lapsed' END, NULL::text;
    END IF;
END $$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_replay_outcome(bigint) FROM PUBLIC;

DROP FUNCTION fanout_record_replay(text, text, bigint, text, text);

-- +goose Down
-- fanout_record_replay comes back without its grant: run the roles.sql of
-- that version again (the operator's `fanout replay` of a binary before
-- this migration records through it).
-- +goose StatementBegin
CREATE FUNCTION fanout_record_replay(p_subscriber text, p_stream text, p_from_seq bigint, p_outcome text, p_comment text)
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp
AS $$
    INSERT INTO replays (subscriber, stream, from_seq, outcome, actor, comment)
    VALUES (p_subscriber, p_stream, p_from_seq, p_outcome, session_user, coalesce(p_comment, ''));
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_record_replay(text, text, bigint, text, text) FROM PUBLIC;
DROP FUNCTION fanout_replay_outcome(bigint);
DROP FUNCTION fanout_replay_finish(bigint, text);
DROP FUNCTION fanout_replay_take(text);
DROP FUNCTION fanout_replay_acts_for(text);
DROP FUNCTION fanout_replay_request(text, text, bigint, interval, text);
DROP INDEX replays_one_outcome;
ALTER TABLE replays DROP COLUMN lapses_at;
ALTER TABLE replays DROP COLUMN request_id;
