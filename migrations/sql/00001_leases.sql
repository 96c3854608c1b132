-- pgfence leases: one row per lease name. The token column is both the lock
-- version and the fencing token. Rows are never deleted and the token never
-- decreases; the triggers below make the schema refuse both.
-- The table is deliberately not UNLOGGED: after a crash an unlogged table is
-- truncated and tokens would start again from 1.

-- +goose Up
CREATE TABLE pgfence_leases (
    name        text        PRIMARY KEY CHECK (octet_length(name) BETWEEN 1 AND 255),
    token       bigint      NOT NULL CHECK (token >= 1),
    holder      text,
    secret      bytea,
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    -- Set by blocked acquirers (and refreshed while they wait) so that a
    -- release sends NOTIFY only when someone is waiting: a committing NOTIFY
    -- takes a database-wide lock that would serialise every release.
    waiters_until timestamptz,
    -- Makes token a key column: a takeover (which changes token) then needs
    -- the FOR UPDATE row lock and waits for a guarded transaction's
    -- FOR KEY SHARE lock, while a renewal (only expires_at changes) does not.
    CONSTRAINT pgfence_leases_name_token_key UNIQUE (name, token),
    CONSTRAINT pgfence_leases_held_has_secret CHECK ((holder IS NULL) = (secret IS NULL))
);

-- +goose StatementBegin
CREATE FUNCTION pgfence_leases_protect() RETURNS trigger
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

-- The WHEN clause is evaluated without calling the function, so the
-- function (and its cost) runs only for an update that is about to be refused.
CREATE TRIGGER pgfence_leases_protect_update BEFORE UPDATE ON pgfence_leases
    FOR EACH ROW WHEN (NEW.token < OLD.token OR NEW.name IS DISTINCT FROM OLD.name)
    EXECUTE FUNCTION pgfence_leases_protect();
CREATE TRIGGER pgfence_leases_protect_delete BEFORE DELETE ON pgfence_leases
    FOR EACH ROW EXECUTE FUNCTION pgfence_leases_protect();
CREATE TRIGGER pgfence_leases_protect_truncate BEFORE TRUNCATE ON pgfence_leases
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence_leases_protect();

-- Wakes blocked acquirers the moment a lease is freed (by the library or by an
-- operator), if any are waiting. The payload names the schema so clients of other schemas that
-- share the database can ignore it.
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

-- pgfence_check is the fence: called inside the protected transaction, it
-- takes a FOR KEY SHARE lock on the lease row (so a takeover, which changes the
-- key column token, waits until the transaction ends) and raises unless the
-- presented token is the newest one issued. Raising (rather than returning a
-- boolean) lets the check be pipelined with the caller's own statements: the
-- server skips everything after the failed check, and the transaction can no
-- longer commit.
--   PF001 stale token (a greater one was issued); DETAIL is the current token
--   PF002 no such lease
--   PF003 token was never issued for this lease
-- The function names its table with the schema it is created in, so it works
-- whatever the caller's search_path is. The name is baked in (rather than a
-- SET search_path clause, which costs a configuration save and restore on
-- every call: about 6-14% of a one-insert guarded transaction, measured).
-- +goose StatementBegin
DO $do$
BEGIN
EXECUTE format($fn$
CREATE FUNCTION %1$I.pgfence_check(p_name text, p_token bigint) RETURNS bigint
LANGUAGE plpgsql
AS $body$
DECLARE
    cur bigint;
BEGIN
    SELECT l.token INTO cur FROM %1$I.pgfence_leases l WHERE l.name = p_name FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgfence: no lease named %%', p_name
            USING ERRCODE = 'PF002';
    END IF;
    IF p_token < cur THEN
        RAISE EXCEPTION 'pgfence: stale token %% for lease %% (current %%)', p_token, p_name, cur
            USING ERRCODE = 'PF001', DETAIL = cur::text;
    END IF;
    IF p_token > cur THEN
        RAISE EXCEPTION 'pgfence: token %% was never issued for lease %% (current %%)', p_token, p_name, cur
            USING ERRCODE = 'PF003', DETAIL = cur::text;
    END IF;
    RETURN cur;
END
$body$
$fn$, current_schema());
END
$do$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION pgfence_check(text, bigint);
DROP TABLE pgfence_leases;
DROP FUNCTION pgfence_leases_notify();
DROP FUNCTION pgfence_leases_protect();
