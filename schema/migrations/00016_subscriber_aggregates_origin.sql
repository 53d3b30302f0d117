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

-- +goose Up
ALTER TABLE subscriber_aggregates ADD COLUMN origin_database text NOT NULL DEFAULT '';
ALTER TABLE subscriber_aggregates DROP CONSTRAINT subscriber_aggregates_pkey;
ALTER TABLE subscriber_aggregates ADD PRIMARY KEY (subscriber, origin_database, aggregate_type, aggregate_id);

-- +goose Down
DELETE FROM subscriber_aggregates WHERE origin_database <> '';
ALTER TABLE subscriber_aggregates DROP CONSTRAINT subscriber_aggregates_pkey;
ALTER TABLE subscriber_aggregates ADD PRIMARY KEY (subscriber, aggregate_type, aggregate_id);
ALTER TABLE subscriber_aggregates DROP COLUMN origin_database;
