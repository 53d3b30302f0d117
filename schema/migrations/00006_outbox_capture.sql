-- Capture from the write-ahead log (relay.capture: wal, see package relay).
--
-- The publication names what a wal relay's replication slot decodes: inserts
-- into the outbox, nothing else (updates and deletes by the poll relay, the
-- cleaner or an operator are not events). It costs nothing while no slot
-- reads it; the slot is created by the relay itself.
--
-- relay_capture remembers, per slot, the outbox rows that were already
-- committed when the slot was created: the slot never decodes them, so a wal
-- relay publishes them as the poll relay would (claim, PubAck, mark sent)
-- before it records backlog_done_at. backlog_through is an upper bound: a
-- pending row with a higher id was inserted after the slot existed.

-- +goose Up
CREATE PUBLICATION fanout_outbox FOR TABLE outbox WITH (publish = 'insert');

CREATE TABLE relay_capture (
    slot_name       text        PRIMARY KEY,
    backlog_through bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    backlog_done_at timestamptz
);

-- +goose Down
DROP TABLE relay_capture;
DROP PUBLICATION fanout_outbox;
