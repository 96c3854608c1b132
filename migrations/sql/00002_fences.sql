-- Resource fences: a per-resource high-water mark of admitted tokens, kept
-- with the protected data (run these migrations in that database and
-- schema). pgfence_admit, inside the transaction that writes the data,
-- admits a token only if it is >= the highest admitted so far.

-- +goose Up
CREATE TABLE pgfence_fences (
    resource    text        PRIMARY KEY CHECK (octet_length(resource) BETWEEN 1 AND 255),
    token       bigint      NOT NULL CHECK (token >= 1),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- +goose StatementBegin
CREATE FUNCTION pgfence_fences_protect() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'pgfence: resource fences are never deleted'
            USING ERRCODE = 'PF010';
    END IF;
    IF NEW.resource IS DISTINCT FROM OLD.resource OR NEW.token < OLD.token THEN
        RAISE EXCEPTION 'pgfence: fence of % cannot move backwards', OLD.resource
            USING ERRCODE = 'PF010';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- A mark never moves backwards and a fence row is never deleted. (The WHEN
-- clause is evaluated without calling the function.)
CREATE TRIGGER pgfence_fences_protect_update BEFORE UPDATE ON pgfence_fences
    FOR EACH ROW WHEN (NEW.token < OLD.token OR NEW.resource IS DISTINCT FROM OLD.resource)
    EXECUTE FUNCTION pgfence_fences_protect();
CREATE TRIGGER pgfence_fences_protect_delete BEFORE DELETE ON pgfence_fences
    FOR EACH ROW EXECUTE FUNCTION pgfence_fences_protect();
CREATE TRIGGER pgfence_fences_protect_truncate BEFORE TRUNCATE ON pgfence_fences
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence_fences_protect();

-- pgfence_admit(resource, token) admits token if it is >= the mark, and
-- keeps the mark from moving until the transaction ends: PF001 (DETAIL: the
-- current mark) for a token below it, which aborts the whole transaction.
-- The common case is a token equal to the mark (a leader writes many times
-- per term): it takes a shared row lock (FOR SHARE), so writers of the same
-- term do not queue on one another. Raising the mark locks the row
-- exclusively (FOR NO KEY UPDATE, which waits for the shared holders) and
-- writes it, once per leadership term. The first read takes no lock: only
-- the locked re-read decides, and a writer never upgrades a shared lock it
-- holds (two upgraders would deadlock). The schema is baked in, as for
-- pgfence_check.
-- +goose StatementBegin
DO $do$
BEGIN
EXECUTE format($fn$
CREATE FUNCTION %1$I.pgfence_admit(p_resource text, p_token bigint) RETURNS bigint
LANGUAGE plpgsql
AS $body$
DECLARE
    cur bigint;
BEGIN
    SELECT f.token INTO cur FROM %1$I.pgfence_fences f WHERE f.resource = p_resource;
    IF cur = p_token THEN
        SELECT f.token INTO cur FROM %1$I.pgfence_fences f WHERE f.resource = p_resource FOR SHARE;
        IF p_token < cur THEN
            RAISE EXCEPTION 'pgfence: stale token %% for resource %% (highest admitted %%)', p_token, p_resource, cur
                USING ERRCODE = 'PF001', DETAIL = cur::text;
        END IF;
        RETURN p_token; -- the mark only rises: here it is still p_token
    END IF;
    SELECT f.token INTO cur FROM %1$I.pgfence_fences f WHERE f.resource = p_resource FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        INSERT INTO %1$I.pgfence_fences (resource, token, updated_at)
        VALUES (p_resource, p_token, now())
        ON CONFLICT (resource) DO NOTHING;
        IF FOUND THEN
            RETURN p_token;
        END IF;
        -- A concurrent first admission inserted it: queue behind it.
        SELECT f.token INTO cur FROM %1$I.pgfence_fences f WHERE f.resource = p_resource FOR NO KEY UPDATE;
    END IF;
    IF p_token < cur THEN
        RAISE EXCEPTION 'pgfence: stale token %% for resource %% (highest admitted %%)', p_token, p_resource, cur
            USING ERRCODE = 'PF001', DETAIL = cur::text;
    END IF;
    IF p_token > cur THEN
        UPDATE %1$I.pgfence_fences f SET token = p_token, updated_at = now() WHERE f.resource = p_resource;
    END IF;
    RETURN p_token;
END
$body$
$fn$, current_schema());
END
$do$;
-- +goose StatementEnd

REVOKE EXECUTE ON FUNCTION pgfence_admit(text, bigint) FROM PUBLIC;

-- +goose Down
DROP FUNCTION pgfence_admit(text, bigint);
DROP TABLE pgfence_fences;
DROP FUNCTION pgfence_fences_protect();
