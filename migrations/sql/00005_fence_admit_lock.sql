-- pgfence_admit no longer writes the fence row when the token is the one
-- already admitted, which is every fenced write of a leadership term but the
-- first. It locks the row (FOR NO KEY UPDATE: concurrent admissions of the
-- resource still queue on it until the transaction ends, exactly as behind the
-- old upsert's row lock) and raises the mark only when the token is greater.
-- The old upsert rewrote the row on every call: a new row version, its WAL,
-- the table's CHECK constraints and the BEFORE UPDATE trigger's row lock, all
-- for an unchanged mark. updated_at now records when the mark last moved.
-- Measured (BenchmarkResourceAdmit, Resource.Exec against the unfenced
-- transaction): see BENCHMARKS.md.

-- +goose Up
-- +goose StatementBegin
DO $do$
BEGIN
EXECUTE format($fn$
CREATE OR REPLACE FUNCTION %1$I.pgfence_admit(p_resource text, p_token bigint) RETURNS bigint
LANGUAGE plpgsql
AS $body$
DECLARE
    cur bigint;
BEGIN
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

-- +goose Down
-- +goose StatementBegin
DO $do$
BEGIN
EXECUTE format($fn$
CREATE OR REPLACE FUNCTION %1$I.pgfence_admit(p_resource text, p_token bigint) RETURNS bigint
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
