-- The ordered subscribers' second checkpoint: per aggregate, the number
-- (outbox.aggregate_seq) of the last event applied. processed_events says
-- whether an event was handled; this row says whether an event is the next
-- one of its aggregate, so an ordered subscriber tells a duplicate (a number
-- at or below last_seq, already in processed_events) from a gap (a number
-- above last_seq + 1: an earlier event has not arrived yet) and from a late
-- event (a number at or below last_seq that was never handled: its
-- aggregate moved on past it). The row is updated in the handler's own
-- transaction, under its row lock: two instances can never apply one
-- aggregate's events at once, nor out of order.
--
-- Only ordered subscribers write rows here (one per aggregate they have
-- seen); rows are never pruned, as an aggregate may have an event tomorrow.

-- +goose Up
CREATE TABLE subscriber_aggregates (
    subscriber     text        NOT NULL,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    -- The number of the last event applied (or let pass: a dead letter
    -- under subscribers.on_dead_letter=skip, or a gap given up on).
    last_seq       bigint      NOT NULL CHECK (last_seq >= 0),
    -- The number applied before it: last_seq - prev_seq > 1 is a gap that
    -- was given up on (subscribers.gap_wait).
    prev_seq       bigint      NOT NULL CHECK (prev_seq >= 0),
    -- The event that set last_seq.
    last_event_id  bigint,
    -- Set while the aggregate is held behind a dead-lettered event
    -- (subscribers.on_dead_letter=hold): its later events are dead-lettered
    -- behind it until it is redriven.
    held_by_event  bigint,
    held_seq       bigint,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscriber, aggregate_type, aggregate_id)
);
CREATE INDEX subscriber_aggregates_held_idx ON subscriber_aggregates (subscriber) WHERE held_by_event IS NOT NULL;

-- +goose Down
DROP TABLE subscriber_aggregates;
