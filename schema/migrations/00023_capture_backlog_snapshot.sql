-- The snapshot in which a wal relay recorded its slot's backlog bound
-- (relay_capture.backlog_through), for relay.atomic transaction: the
-- backlog is then published by writer transactions, and a transaction is
-- in it when it is visible in this snapshot (committed before the
-- record; all its rows have ids up to the bound). One that is not (in
-- flight at the record, its rows' ids possibly below the bound) commits
-- after the slot existed, so the slot decodes it whole. An id bound alone
-- cannot tell the two apart. NULL for a record made before this
-- migration: that backlog goes event by event, as before.

-- +goose Up
ALTER TABLE relay_capture ADD COLUMN backlog_snapshot pg_snapshot;

-- +goose Down
ALTER TABLE relay_capture DROP COLUMN backlog_snapshot;
