-- An ordered subscriber's per-aggregate checkpoint keys on the aggregate's
-- database too (DESIGN.md, invariant 10). Two databases that share a
-- stream (stream.databases several) each have an order 42, numbered 1, 2,
-- 3 by their own trigger: under one key, the second database's events
-- would be taken for duplicates or late events of the first's.
--
-- origin_database is "" for the subscriber's own database (every row
-- before this migration, and nearly every row after) and the database as
-- the event's Fanout-Origin names it ("<system identifier>/<name>") for
-- any other. Epochs are not part of the key: a restored database's
-- aggregates go on numbering from the backup's counters, and its events
-- follow the ones the subscriber applied before the restore.

--
-- The events in subscriber_aggregates (last_event_id, held_by_event) are
-- their checkpoint keys, as in processed_events (package subscribers,
-- origin.go): the event id for this database's first epoch, so the rows
-- already there keep their meaning. fanout_dead_letter_action takes the
-- key beside the id: a redrive is checked against the checkpoint by the
-- key, a discard releases the aggregate held behind that key, and the
-- audit trail and the vouch (dead_letters, by stream sequence) keep the
-- event's id.

-- +goose Up
ALTER TABLE subscriber_aggregates ADD COLUMN origin_database text NOT NULL DEFAULT '';
ALTER TABLE subscriber_aggregates DROP CONSTRAINT subscriber_aggregates_pkey;
ALTER TABLE subscriber_aggregates ADD PRIMARY KEY (subscriber, origin_database, aggregate_type, aggregate_id);

DROP FUNCTION fanout_dead_letter_action(text, text, bigint, bigint, bigint, text, text);
-- +goose StatementBegin
-- p_letter_seq is the letter's sequence in the dead-letter stream (what
-- dead_letter_actions.stream_seq holds), p_event_seq the events stream
-- sequence the letter names (what dead_letters.stream_seq holds), p_event_key
-- the event's checkpoint key (what processed_events.event_id and
-- subscriber_aggregates.held_by_event hold).
CREATE FUNCTION fanout_dead_letter_action(p_action text, p_subscriber text, p_event_id bigint, p_letter_seq bigint,
                                          p_event_seq bigint, p_outcome text, p_comment text, p_event_key bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp
AS $$
BEGIN
    IF p_action = 'redrive' AND p_outcome IN ('handled', 'already in the checkpoint')
       AND NOT EXISTS (SELECT 1 FROM processed_events WHERE subscriber = p_subscriber AND event_id = p_event_key) THEN
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
        WHERE subscriber = p_subscriber AND held_by_event = p_event_key;
    END IF;
    INSERT INTO dead_letter_actions (action, subscriber, event_id, stream_seq, outcome, actor, comment)
    VALUES (p_action, p_subscriber, nullif(p_event_id, 0), p_letter_seq, p_outcome, session_user, coalesce(p_comment, ''));
END
$$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_dead_letter_action(text, text, bigint, bigint, bigint, text, text, bigint) FROM PUBLIC;

-- +goose Down
DROP FUNCTION fanout_dead_letter_action(text, text, bigint, bigint, bigint, text, text, bigint);
-- +goose StatementBegin
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
DELETE FROM subscriber_aggregates WHERE origin_database <> '';
ALTER TABLE subscriber_aggregates DROP CONSTRAINT subscriber_aggregates_pkey;
ALTER TABLE subscriber_aggregates ADD PRIMARY KEY (subscriber, aggregate_type, aggregate_id);
ALTER TABLE subscriber_aggregates DROP COLUMN origin_database;
