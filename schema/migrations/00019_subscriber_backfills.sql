-- Backfills (`fanout backfill <subscriber>`, package subscribers, "Backfill"):
-- a subscriber whose declaration names the table its state derives from
-- reads that table's current rows in key order, in chunks, and handles each
-- row as an event. One row per subscriber holds its backfill; its key
-- range is split into segments that workers read side by side, and each
-- segment's row holds the last key done in it, committed in the same
-- transaction as the chunk's effects for a subscriber whose effects are in
-- Postgres, so a backfill killed at any moment resumes after the last chunk
-- that committed in each segment, skipping no row and applying none twice.
--
-- Rows of the table the backfill cannot apply (the handler's own verdict:
-- a permanent error, or max_failures failures) are its dead letters, kept
-- in subscriber_backfill_failures with the reason: the row is in Postgres,
-- there is no message to copy.

-- +goose Up
CREATE TABLE subscriber_backfills (
    subscriber  text        PRIMARY KEY,
    -- The operator's filter (`--where`), applied to every chunk's read.
    where_sql   text        NOT NULL DEFAULT '',
    -- The greatest key when the backfill started: rows written after it
    -- reach the subscriber as live events.
    high_key    bigint      NOT NULL,
    -- Rows to do at the start, rows done and rows failed since.
    total_rows  bigint      NOT NULL CHECK (total_rows >= 0),
    done_rows   bigint      NOT NULL DEFAULT 0 CHECK (done_rows >= 0),
    failed_rows bigint      NOT NULL DEFAULT 0 CHECK (failed_rows >= 0),
    -- Set by `fanout backfill <subscriber> --pause`: the running backfill
    -- stops between chunks until it is cleared (--resume).
    paused      boolean     NOT NULL DEFAULT false,
    started_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);

CREATE TABLE subscriber_backfill_segments (
    subscriber text   NOT NULL REFERENCES subscriber_backfills ON DELETE CASCADE,
    segment    int    NOT NULL,
    -- The segment's keys: after from_key, up to to_key.
    from_key   bigint NOT NULL,
    to_key     bigint NOT NULL,
    -- The last key done in it; the next chunk starts after it.
    last_key   bigint NOT NULL,
    PRIMARY KEY (subscriber, segment)
);

CREATE TABLE subscriber_backfill_failures (
    subscriber text        NOT NULL,
    row_key    bigint      NOT NULL,
    reason     text        NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscriber, row_key)
);

-- +goose Down
DROP TABLE subscriber_backfill_failures;
DROP TABLE subscriber_backfill_segments;
DROP TABLE subscriber_backfills;
