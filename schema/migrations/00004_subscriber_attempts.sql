-- What the subscriber runtime remembers about events that did not go well
-- the first time: how often the handler itself failed on an event, and how
-- many attempts began and never ended (their process died). JetStream's own
-- delivery count cannot tell these apart from deliveries lost to an outage
-- of a dependency, which must never count against an event; so the server
-- redelivers without limit and the runtime decides, from these rows, when an
-- event goes to the dead letters.
--
-- Rows exist only for events that failed or were redelivered; a first
-- delivery that succeeds writes nothing here. A row is deleted when its
-- event is handled or dead-lettered, and rows older than the stream's
-- max_age are pruned with the checkpoint.

-- +goose Up
CREATE TABLE subscriber_attempts (
    subscriber    text        NOT NULL,
    event_id      bigint      NOT NULL,
    -- Times the handler failed on the event by its own verdict (an error
    -- while every dependency answered).
    failures      integer     NOT NULL DEFAULT 0 CHECK (failures >= 0),
    -- Attempts on a redelivered event begun and not yet ended. One still
    -- open when the event arrives again is a process that died handling it.
    open_attempts integer     NOT NULL DEFAULT 0 CHECK (open_attempts >= 0),
    last_error    text,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscriber, event_id)
);
-- Pruning is per subscriber, by age.
CREATE INDEX subscriber_attempts_prune_idx ON subscriber_attempts (subscriber, updated_at);

-- +goose Down
DROP TABLE subscriber_attempts;
