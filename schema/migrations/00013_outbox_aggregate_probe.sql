-- The index of unpublished events by aggregate (00009), with its predicate
-- written so that the planner can never take outbox_unsent_idx for it.
--
-- The relay probes it for every row it might claim: is an earlier event of
-- this row's aggregate still to be published? Both indexes covered exactly
-- the unpublished rows (published_at IS NULL), so a probe saying
-- published_at IS NULL could also read the whole of outbox_unsent_idx; and
-- as both indexes are nearly empty whenever vacuum or analyze looks (a
-- backlog is small and short-lived), the planner thinks either is free,
-- and often took the whole of outbox_unsent_idx: once per claim, or once
-- per row probed. While a snapshot is held (a long report, a stuck
-- session) that index keeps an entry for every row published since, and
-- such a claim read tens of thousands of pages two minutes into one, and
-- then timed out.
--
-- num_nulls(published_at) = 1 says the same as published_at IS NULL, in
-- words the planner does not equate with it: the probes (package outbox)
-- say these words, and only this index answers them. The index holds the
-- same entries as before.
--
-- The index is rebuilt in the migration's transaction, which holds off
-- writers and relays while it reads the outbox (retention keeps it to
-- the rows of the last days).

-- +goose Up
DROP INDEX outbox_aggregate_unsent_idx;
CREATE INDEX outbox_aggregate_unsent_idx ON outbox (aggregate_type, aggregate_id, aggregate_seq)
    WHERE num_nulls(published_at) = 1;

-- +goose Down
DROP INDEX outbox_aggregate_unsent_idx;
CREATE INDEX outbox_aggregate_unsent_idx ON outbox (aggregate_type, aggregate_id, aggregate_seq)
    WHERE published_at IS NULL;
