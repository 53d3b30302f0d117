-- Dead letters a subscriber's runtime vouches for, and audit trails (of
-- dead letters resolved, of replays) that say who.
--
-- dead_letters: a subscriber's runtime records each event it dead-letters,
-- as its own Postgres role, before it publishes the letter: the events
-- stream sequence, the event id, and a digest of the event (its subject,
-- the headers an event is read from, its body). Row-level security
-- (deploy/postgres/roles.sql) lets each subscriber's role write rows under
-- its own name only, so a letter that matches a row was written by that
-- subscriber, about that event: forging one takes its NATS and its
-- Postgres credentials. The operator tools redrive only such letters, and
-- trust a letter's own copy of an event only when its digest matches too
-- (and the truth, the outbox row and the stream, no longer holds it).
--
-- fanout_dead_letter_action: the only way to add to dead_letter_actions
-- (roles.sql grants the operator EXECUTE on it and no INSERT on the
-- table). It records the session's role as the actor (the caller's own
-- words go in comment); refuses a redrive recorded as handled when the
-- subscriber has no checkpoint of the event; makes a discard release the
-- aggregate an ordered subscriber holds behind the event, in the same
-- transaction; and refuses to discard a letter no subscriber vouches for
-- without a reason.

-- +goose Up
CREATE TABLE dead_letters (
    subscriber text        NOT NULL,
    stream_seq bigint      NOT NULL,
    event_id   bigint      NOT NULL, -- 0: the message carried no event id
    digest     bytea       NOT NULL, -- subscribers.LetterDigest of the event
    at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscriber, stream_seq)
);

ALTER TABLE dead_letter_actions ADD COLUMN comment text NOT NULL DEFAULT '';

-- +goose StatementBegin
-- p_letter_seq is the letter's sequence in the dead-letter stream (what
-- dead_letter_actions.stream_seq holds), p_event_seq the events stream
-- sequence the letter names (what dead_letters.stream_seq holds).
CREATE FUNCTION fanout_dead_letter_action(p_action text, p_subscriber text, p_event_id bigint, p_letter_seq bigint,
                                          p_event_seq bigint, p_outcome text, p_comment text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
AS $$
BEGIN
    IF p_action = 'redrive' AND p_outcome IN ('handled', 'already in the checkpoint')
       AND NOT EXISTS (SELECT 1 FROM processed_events WHERE subscriber = p_subscriber AND event_id = p_event_id) THEN
        RAISE EXCEPTION 'redrive of event % recorded as "%", but subscriber % has no checkpoint of it', p_event_id, p_outcome, p_subscriber
            USING ERRCODE = 'check_violation';
    END IF;
    IF p_action = 'discard' THEN
        IF coalesce(p_comment, '') = ''
           AND NOT EXISTS (SELECT 1 FROM dead_letters
                           WHERE subscriber = p_subscriber AND stream_seq = p_event_seq AND event_id = coalesce(p_event_id, 0)) THEN
            RAISE EXCEPTION 'letter % is not vouched for by subscriber % (no dead_letters row for events sequence %): a discard of it needs a reason',
                p_letter_seq, p_subscriber, p_event_seq
                USING ERRCODE = 'check_violation';
        END IF;
        UPDATE subscriber_aggregates
        SET last_seq = held_seq, prev_seq = last_seq, last_event_id = held_by_event, held_by_event = NULL, held_seq = NULL, updated_at = now()
        WHERE subscriber = p_subscriber AND held_by_event = p_event_id;
    END IF;
    INSERT INTO dead_letter_actions (action, subscriber, event_id, stream_seq, outcome, actor, comment)
    VALUES (p_action, p_subscriber, nullif(p_event_id, 0), p_letter_seq, p_outcome, session_user, coalesce(p_comment, ''));
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_dead_letter_action(text, text, bigint, bigint, bigint, text, text) FROM PUBLIC;

-- Replays: `fanout replay` moves a subscriber's consumer back (or, as the
-- same reset allows, forward: the events between are then never
-- delivered to it). Each one is recorded, the same way, through a function
-- that names the session's role.
CREATE TABLE replays (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    subscriber text        NOT NULL,
    stream     text        NOT NULL,
    from_seq   bigint      NOT NULL,
    outcome    text        NOT NULL,
    actor      text        NOT NULL,
    comment    text        NOT NULL DEFAULT '',
    at         timestamptz NOT NULL DEFAULT now()
);

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

-- +goose Down
DROP FUNCTION fanout_record_replay(text, text, bigint, text, text);
DROP TABLE replays;
DROP FUNCTION fanout_dead_letter_action(text, text, bigint, bigint, bigint, text, text);
ALTER TABLE dead_letter_actions DROP COLUMN comment;
DROP TABLE dead_letters;
