-- Acquisitions become HOT updates: tokens come from a sequence, token is no
-- longer indexed, and no row trigger runs on UPDATE.
--
-- token becomes an identity column (GENERATED ALWAYS): an acquisition sets
-- token = DEFAULT, i.e. nextval() of the column's sequence, and nothing else
-- can set it, so the schema itself refuses a decrease ("UPDATE ... SET token =
-- token - 1" fails with SQLSTATE 428C9) without a trigger. Every token is
-- drawn from one sequence for all leases of this table, so a new token is
-- greater than every token issued before it, for its lease and for any other
-- (a row an operator renamed included). Tokens of one lease therefore still
-- rise strictly, but no longer by one. The value written is always a
-- nextval() taken after the row's current version committed: when a
-- concurrent acquisition commits first, PostgreSQL re-evaluates the UPDATE
-- (WHERE and new values, so a fresh nextval()) against the new version.
-- The sequence must keep CACHE 1 (the default): with a per-session cache,
-- values taken by different sessions no longer rise in time order. An INSERT
-- can still override the default (OVERRIDING SYSTEM VALUE); a BEFORE INSERT
-- trigger (which runs only on a name's first acquisition) refuses a token the
-- sequence has not issued yet, since later acquisitions would go below it.
--
-- UNIQUE (name, token) is dropped. It made token a key column, so that a
-- takeover needed the FOR UPDATE row lock and waited for a guarded
-- transaction's FOR KEY SHARE lock (pgfence_check) while renewals did not.
-- The library's acquisition now takes FOR UPDATE explicitly instead (a
-- locking subquery before its UPDATE), with the same effect: PostgreSQL
-- records the update made under that lock as a key update, so guarded
-- transactions that come later wait for it too. Renewals and releases still
-- take only the weaker lock and never wait for a guarded transaction. With no
-- index on any column an acquisition changes, acquisitions are HOT updates: no
-- new index entries, and pages are pruned without VACUUM. With the index,
-- each acquisition added an entry to both indexes and left a dead line
-- pointer that only VACUUM reclaims: under sustained acquisitions the table
-- and the (name, token) index grew by hundreds of pages between autovacuum
-- runs, and once the table had statistics the planner scanned all of it.
--
-- fillfactor 10 keeps nine tenths of each page free for those HOT updates,
-- and spreads rows over more pages, so fewer backends pin the same page and
-- block its pruning. An update that does not fit on its row's page is not
-- HOT: it moves the row to another page and, when several backends need room
-- at once, PostgreSQL extends the table by many pages at a time (measured: 8
-- such updates out of 900,000 left a table of 8 rows at 162 pages, which
-- every sequential scan then read). The table holds one short row per lease
-- name, so the space is small.
--
-- A consequence operators must know: a token raised by hand (UPDATE ... SET
-- token = DEFAULT) must lock the row FOR UPDATE first, as the library does,
-- or a guarded transaction already past its check could still commit.
--
-- The table's three CHECK constraints move into that BEFORE INSERT trigger.
-- PostgreSQL prepares every CHECK expression of a table anew for each UPDATE
-- statement that touches it, whichever columns change: with three, about 15
-- microseconds per acquisition and per release, a sixth of an acquire+release
-- pair's CPU at 8 clients (measured). What they guarded is set only at
-- insert time (name, the first token) or only by the library's statements
-- (holder and secret, always set and cleared together).
--
-- Why no UPDATE triggers: a row-level UPDATE trigger makes every UPDATE of
-- the table fetch (for BEFORE triggers: lock, which writes a WAL record) the
-- old row version and evaluate the WHEN clauses, whether or not they match.
-- The two dropped here cost about 8% of acquire+release throughput at 8
-- clients (BENCHMARKS.md). The release notification they sent is now sent by
-- the library's release statements themselves, through pgfence_wake_waiters
-- below (same channel, same payload); a lease freed by hand (UPDATE ... SET
-- holder = NULL) sends none, and waiters find it by polling. DELETE and
-- TRUNCATE stay refused by their triggers, which cost nothing on UPDATE.

-- +goose Up
ALTER TABLE pgfence_leases DROP CONSTRAINT pgfence_leases_name_token_key;
ALTER TABLE pgfence_leases DROP CONSTRAINT pgfence_leases_name_check;
ALTER TABLE pgfence_leases DROP CONSTRAINT pgfence_leases_token_check;
ALTER TABLE pgfence_leases DROP CONSTRAINT pgfence_leases_held_has_secret;
ALTER TABLE pgfence_leases SET (fillfactor = 10);
DROP TRIGGER pgfence_leases_protect_update ON pgfence_leases;
DROP TRIGGER pgfence_leases_released ON pgfence_leases;
DROP FUNCTION pgfence_leases_notify();

ALTER TABLE pgfence_leases ALTER COLUMN token ADD GENERATED ALWAYS AS IDENTITY (CACHE 1);
-- Start above every token already issued.
SELECT setval(pg_get_serial_sequence('pgfence_leases', 'token'), coalesce(max(token), 0) + 1, false)
  FROM pgfence_leases;

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence_leases_protect() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: lease rows are never deleted (tokens must not restart)'
        USING ERRCODE = 'PF010';
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION pgfence_leases_check_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    issued bigint := pg_sequence_last_value(
        pg_get_serial_sequence(format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME), 'token'));
BEGIN
    IF NEW.token < 1 OR NEW.token > coalesce(issued, 0) THEN
        RAISE EXCEPTION 'pgfence: token % of lease % was not issued by the token sequence (last issued %)',
            NEW.token, NEW.name, issued
            USING ERRCODE = 'PF010';
    END IF;
    IF octet_length(NEW.name) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION 'pgfence: a lease name must be 1 to 255 bytes long'
            USING ERRCODE = '23514';
    END IF;
    IF (NEW.holder IS NULL) <> (NEW.secret IS NULL) THEN
        RAISE EXCEPTION 'pgfence: a held lease has a secret and a free one has none'
            USING ERRCODE = '23514';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER pgfence_leases_check_insert BEFORE INSERT ON pgfence_leases
    FOR EACH ROW EXECUTE FUNCTION pgfence_leases_check_insert();

-- pgfence_wake_waiters(name) sends the release notification that blocked
-- acquirers listen for; release statements call it only when a waiter asked
-- (waiters_until). The payload names the schema, baked in here like
-- pgfence_check's, so listeners of other schemas in the database ignore it.
-- +goose StatementBegin
DO $do$
BEGIN
EXECUTE format($fn$
CREATE FUNCTION %1$I.pgfence_wake_waiters(p_name text) RETURNS boolean
LANGUAGE sql
AS $body$
    SELECT pg_notify('pgfence_released', json_build_object('schema', %2$L::text, 'name', p_name)::text) IS NOT NULL
$body$
$fn$, current_schema(), current_schema());
END
$do$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION pgfence_wake_waiters(text);
DROP TRIGGER pgfence_leases_check_insert ON pgfence_leases;
DROP FUNCTION pgfence_leases_check_insert();

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION pgfence_leases_protect() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'pgfence: lease rows are never deleted (tokens must not restart)'
            USING ERRCODE = 'PF010';
    END IF;
    IF NEW.name IS DISTINCT FROM OLD.name THEN
        RAISE EXCEPTION 'pgfence: a lease cannot be renamed'
            USING ERRCODE = 'PF010';
    END IF;
    IF NEW.token < OLD.token THEN
        RAISE EXCEPTION 'pgfence: token of lease % cannot decrease from % to %', OLD.name, OLD.token, NEW.token
            USING ERRCODE = 'PF010';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

ALTER TABLE pgfence_leases ALTER COLUMN token DROP IDENTITY;
ALTER TABLE pgfence_leases ADD CONSTRAINT pgfence_leases_name_token_key UNIQUE (name, token);
ALTER TABLE pgfence_leases RESET (fillfactor);
ALTER TABLE pgfence_leases ADD CONSTRAINT pgfence_leases_name_check CHECK (octet_length(name) BETWEEN 1 AND 255);
ALTER TABLE pgfence_leases ADD CONSTRAINT pgfence_leases_token_check CHECK (token >= 1);
ALTER TABLE pgfence_leases ADD CONSTRAINT pgfence_leases_held_has_secret CHECK ((holder IS NULL) = (secret IS NULL));

CREATE TRIGGER pgfence_leases_protect_update BEFORE UPDATE ON pgfence_leases
    FOR EACH ROW WHEN (NEW.token < OLD.token OR NEW.name IS DISTINCT FROM OLD.name)
    EXECUTE FUNCTION pgfence_leases_protect();

-- +goose StatementBegin
CREATE FUNCTION pgfence_leases_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pgfence_released',
        json_build_object('schema', TG_TABLE_SCHEMA, 'name', NEW.name)::text);
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER pgfence_leases_released AFTER UPDATE ON pgfence_leases
    FOR EACH ROW WHEN (OLD.holder IS NOT NULL AND NEW.holder IS NULL AND OLD.waiters_until > now())
    EXECUTE FUNCTION pgfence_leases_notify();
