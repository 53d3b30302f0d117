-- A wal relay also decodes updates of outbox rows (see package relay): an
-- update that leaves a row pending and unpublished is an operator returning
-- it to the relay (`fanout outbox retry-failed`, `fanout outbox republish`,
-- or a hand-written UPDATE), and the wal relay publishes it as it would an
-- insert. Every other update (a claim, a mark, a failure) is decoded and
-- skipped. Deletes are still not decoded: retention is not an event.
--
-- Publishing updates needs a replica identity; the outbox's primary key
-- is it. While no slot reads the publication this costs nothing.

-- +goose Up
ALTER PUBLICATION fanout_outbox SET (publish = 'insert, update');

-- +goose Down
ALTER PUBLICATION fanout_outbox SET (publish = 'insert');
