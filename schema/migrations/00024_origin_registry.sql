-- Origin numbers only for origins Postgres can vouch for (issue 47, item
-- 3). fanout_origin_number numbered whatever read as an origin, and its
-- 32767 numbers are every subscriber's: one subscriber's role numbering
-- made-up origins took them all, and every subscriber then dead-lettered
-- the events of any new origin. Now an origin of this database is
-- numbered only for an epoch its outbox began (outbox_epochs), and one of
-- another database only if an operator registered that database
-- (`fanout outbox allow-origin`: databases whose relays share the
-- stream), at most 100 epochs of each: a role can no longer take the
-- numbers the others need.

-- +goose Up
CREATE TABLE origin_databases (
    system_identifier text        NOT NULL CHECK (system_identifier ~ '^[0-9]{1,20}$'),
    database          text        NOT NULL CHECK (database <> '' AND database !~ '/'),
    registered_at     timestamptz NOT NULL DEFAULT now(),
    registered_by     text        NOT NULL DEFAULT current_user,
    reason            text        NOT NULL CHECK (btrim(reason) <> ''),
    PRIMARY KEY (system_identifier, database)
);

-- +goose StatementBegin
-- fanout_origin_allow registers another database whose events share the
-- stream (the operator's `fanout outbox allow-origin`); true if it is new.
CREATE FUNCTION fanout_origin_allow(p_system text, p_database text, p_reason text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    added boolean;
BEGIN
    INSERT INTO public.origin_databases (system_identifier, database, reason, registered_by)
    VALUES (p_system, p_database, p_reason, session_user)
    ON CONFLICT DO NOTHING
    RETURNING true INTO added;
    RETURN coalesce(added, false);
END
$$;
-- +goose StatementEnd
REVOKE EXECUTE ON FUNCTION fanout_origin_allow(text, text, text) FROM PUBLIC;

-- +goose StatementBegin
-- fanout_origin_number numbers an origin, once, if Postgres can vouch for
-- it: an epoch this database's outbox began, or an epoch of a registered
-- database (at most 100 of each). NULL when it may
-- number no more (the event is then dead-lettered, with the reason); an
-- origin it cannot vouch for is refused (22023), and dead-lettered too.
CREATE OR REPLACE FUNCTION fanout_origin_number(p_origin text) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
    parts text[];
    own_system text;
    numbered integer;
BEGIN
    parts := regexp_match(p_origin, '^([0-9]{1,20})/([^/]+)/([1-9][0-9]{0,9})$');
    IF parts IS NULL OR length(p_origin) > 200 THEN
        RAISE EXCEPTION 'not an origin: %', left(p_origin, 200) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT num INTO n FROM public.event_origins WHERE origin = p_origin;
    IF n IS NOT NULL THEN
        RETURN n;
    END IF;
    SELECT system_identifier::text INTO own_system FROM pg_control_system();
    IF parts[1] = own_system AND parts[2] = current_database() THEN
        IF NOT EXISTS (SELECT FROM public.outbox_epochs WHERE epoch = parts[3]::bigint) THEN
            RAISE EXCEPTION 'origin %: this database''s outbox began no epoch %', p_origin, parts[3]
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    ELSE
        IF NOT EXISTS (SELECT FROM public.origin_databases WHERE system_identifier = parts[1] AND database = parts[2]) THEN
            RAISE EXCEPTION 'origin %: database %/% is not registered (fanout outbox allow-origin)', p_origin, parts[1], parts[2]
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- One database's epochs cannot take the numbers the others need.
        LOCK TABLE public.event_origins IN SHARE ROW EXCLUSIVE MODE;
        SELECT count(*) INTO numbered FROM public.event_origins WHERE origin LIKE parts[1] || '/' || replace(replace(replace(parts[2], '\', '\\'), '%', '\%'), '_', '\_') || '/%';
        IF numbered >= 100 THEN
            RETURN NULL;
        END IF;
    END IF;
    BEGIN
        INSERT INTO public.event_origins (origin) VALUES (p_origin) ON CONFLICT (origin) DO NOTHING RETURNING num INTO n;
    EXCEPTION WHEN sequence_generator_limit_exceeded THEN
        RETURN NULL;
    END;
    IF n IS NULL THEN
        SELECT num INTO n FROM public.event_origins WHERE origin = p_origin;
    END IF;
    RETURN n;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION fanout_origin_number(p_origin text) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    IF p_origin IS NULL OR p_origin !~ '^[0-9]{1,20}/[^/]+/[1-9][0-9]{0,9}$' OR length(p_origin) > 200 THEN
        RAISE EXCEPTION 'not an origin: %', left(p_origin, 200) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT num INTO n FROM public.event_origins WHERE origin = p_origin;
    IF n IS NOT NULL THEN
        RETURN n;
    END IF;
    BEGIN
        INSERT INTO public.event_origins (origin) VALUES (p_origin) ON CONFLICT (origin) DO NOTHING RETURNING num INTO n;
    EXCEPTION WHEN sequence_generator_limit_exceeded THEN
        RETURN NULL;
    END;
    IF n IS NULL THEN
        SELECT num INTO n FROM public.event_origins WHERE origin = p_origin;
    END IF;
    RETURN n;
END
$$;
-- +goose StatementEnd
DROP FUNCTION fanout_origin_allow(text, text, text);
DROP TABLE origin_databases;
