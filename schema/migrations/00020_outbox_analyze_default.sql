-- fanout_outbox_analyze (migration 00018) analyzes outbox_default too.
-- A new database's first ids lie below the first range the relays make
-- (ahead of the identity), so its first events land in outbox_default,
-- and so do the rows of any range that did not exist in time. Analyzed
-- while nearly empty, outbox_default kept the claim on nested loops of
-- sequential scans over it: in bench:backfill (500 orders/s into a new
-- database, autovacuum busy with the backfill's tables) a claim took
-- 15 to 30 s once it held some 10,000 rows, and live events waited as
-- long. It is analyzed with the ranges, whenever a claim finds a backlog.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_analyze(from_id bigint) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp SET lock_timeout = '100ms'
AS $$
DECLARE
    part text;
    analyzed integer := 0;
BEGIN
    FOR part IN SELECT name FROM outbox_partitions WHERE upper_id > from_id UNION ALL SELECT 'outbox_default' LOOP
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

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_outbox_analyze(from_id bigint) RETURNS integer
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
