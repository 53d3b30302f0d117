-- What operators did with dead letters: who redrove or discarded which
-- event, for which subscriber, and how it went.

-- +goose Up
CREATE TABLE dead_letter_actions (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action     text        NOT NULL CHECK (action IN ('redrive', 'discard')),
    subscriber text        NOT NULL,
    event_id   bigint,
    stream_seq bigint      NOT NULL,
    outcome    text        NOT NULL,
    actor      text        NOT NULL,
    at         timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE dead_letter_actions;
