-- Resource fences: a per-resource high-water mark kept with the protected data.
-- Run these migrations in the database (and schema) that holds the data; the
-- fence admits a token only if it is >= the highest admitted so far, inside the
-- transaction that writes the data.

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

CREATE TRIGGER pgfence_fences_protect_update BEFORE UPDATE ON pgfence_fences
    FOR EACH ROW WHEN (NEW.token < OLD.token OR NEW.resource IS DISTINCT FROM OLD.resource)
    EXECUTE FUNCTION pgfence_fences_protect();
CREATE TRIGGER pgfence_fences_protect_delete BEFORE DELETE ON pgfence_fences
    FOR EACH ROW EXECUTE FUNCTION pgfence_fences_protect();
CREATE TRIGGER pgfence_fences_protect_truncate BEFORE TRUNCATE ON pgfence_fences
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence_fences_protect();

-- pgfence_admit is the resource fence: inside the transaction that writes the
-- protected data it raises the resource's high-water mark to p_token, or raises
-- PF001 (DETAIL: the current mark) when a greater token has been admitted. The
-- upsert holds the fence row's lock until the transaction ends, so a concurrent
-- writer with another token waits and then sees this one's outcome. Raising
-- aborts the whole transaction: a refused write cannot be committed by mistake.
-- The schema is baked into the body, as for pgfence_check.
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
    INSERT INTO %1$I.pgfence_fences AS f (resource, token, updated_at)
    VALUES (p_resource, p_token, now())
    ON CONFLICT (resource) DO UPDATE
        SET token = EXCLUDED.token, updated_at = EXCLUDED.updated_at
        WHERE f.token <= EXCLUDED.token
    RETURNING f.token INTO cur;
    IF NOT FOUND THEN
        SELECT f.token INTO cur FROM %1$I.pgfence_fences f WHERE f.resource = p_resource;
        RAISE EXCEPTION 'pgfence: stale token %% for resource %% (highest admitted %%)', p_token, p_resource, cur
            USING ERRCODE = 'PF001', DETAIL = cur::text;
    END IF;
    RETURN cur;
END
$body$
$fn$, current_schema());
END
$do$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION pgfence_admit(text, bigint);
DROP TABLE pgfence_fences;
DROP FUNCTION pgfence_fences_protect();
