-- Fresh statistics for the claim after a burst (package relay, "Claiming
-- a burst"). The planner knows the outbox's ranges by the statistics of
-- their last ANALYZE, and a session keeps the plans it made with them
-- until the next: a relay that started on a quiet outbox goes on sorting
-- every unpublished row of a range for each claim's window once a bulk
-- import commits 300,000 rows into it, where a walk of the id index stops
-- after the window. In bench:relay's bigtx part (one transaction of
-- 300,000 events, an aggregate each) the drain ran at 0.64 of the same
-- rows committed in transactions of 1000 (fresh statistics), and at 0.94
-- once the relay asked for this. Autovacuum would analyze it too,
-- within a minute or so: long after the burst. So the relay, seeing a
-- backlog the statistics cannot know of, asks for an ANALYZE of the ranges
-- that hold unpublished rows (those above its claim floor); the relay's
-- role owns no table, hence a function.
--
-- It waits at most 100 ms for a range's lock (an autovacuum analyzing it,
-- or a retention pass) and skips it: whoever holds the lock is freshening
-- it or dropping it. It returns the ranges analyzed.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION fanout_outbox_analyze(from_id bigint) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '100ms'
AS $$
DECLARE
    part text;
    analyzed integer := 0;
BEGIN
    FOR part IN SELECT name FROM outbox_partitions WHERE upper_id > from_id ORDER BY upper_id LOOP
        BEGIN
            EXECUTE format('ANALYZE %I', part);
            analyzed := analyzed + 1;
        EXCEPTION WHEN lock_not_available OR undefined_table THEN
            NULL; -- being analyzed, vacuumed or dropped by someone else
        END;
    END LOOP;
    RETURN analyzed;
END $$;
-- +goose StatementEnd
REVOKE ALL ON FUNCTION fanout_outbox_analyze(bigint) FROM PUBLIC;

-- +goose Down
DROP FUNCTION fanout_outbox_analyze(bigint);
