-- The transactional outbox (DESIGN.md, "Outbox row") and the subscribers'
-- processed-events checkpoint.

-- +goose Up
CREATE TABLE outbox (
    -- The event id, and the JetStream Nats-Msg-Id: JetStream drops a second
    -- publish of the same id inside the stream's duplicates window.
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}',
    status         text        NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'sending', 'sent', 'failed')),
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text,
    -- A failed publish pushes this into the future (exponential backoff).
    available_at   timestamptz NOT NULL DEFAULT now(),
    -- Set with lease_token when a relay claims the row; a relay marks the row
    -- only while its token still matches, so a relay that stalled past its
    -- lease cannot overwrite a newer claim.
    claimed_at     timestamptz,
    lease_token    uuid,
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz
);

-- Unsent rows (pending, sending, failed), in id order: the claim walks it for
-- pending rows, the reaper for expired leases, operators for failed rows.
-- Its predicate names only published_at, and no index names status,
-- claimed_at or lease_token: so a claim (pending -> sending), a retry and a
-- reap are HOT updates that write no index entry, and with the fillfactor
-- below the new row version fits on the same page. Measured: claims cost half
-- as much as with status-based partial indexes, and claims bound the relay's
-- throughput. Sent rows leave this index and are found through the primary
-- key (they hold the old ids). Failed rows stay in it; they are few, and
-- `fanout outbox retry-failed` returns them to pending.
CREATE INDEX outbox_unsent_idx ON outbox (id) WHERE published_at IS NULL;
ALTER TABLE outbox SET (fillfactor = 50);

CREATE TABLE processed_events (
    subscriber   text        NOT NULL,
    event_id     bigint      NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (subscriber, event_id)
);
-- Checkpoint retention prunes by age.
CREATE INDEX processed_events_processed_at_idx ON processed_events (processed_at);

-- +goose Down
DROP TABLE processed_events;
DROP TABLE outbox;
