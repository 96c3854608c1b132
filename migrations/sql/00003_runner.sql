-- The runner's run ledger and its live instances.

-- +goose Up
-- One row per (job, shard, slot): the attempt that last claimed the slot,
-- with its lease token. Success is recorded in a transaction fenced by that
-- token and conditioned on it, so a zombie's late success is refused; a
-- succeeded row never changes again (trigger below). Unsharded jobs use
-- shard 0.
CREATE TABLE pgfence_runs (
    job         text        NOT NULL,
    shard       integer     NOT NULL CHECK (shard >= 0),
    slot        timestamptz NOT NULL,
    attempt     integer     NOT NULL CHECK (attempt >= 1),
    token       bigint      NOT NULL CHECK (token >= 1),
    status      text        NOT NULL CHECK (status IN ('running', 'succeeded', 'failed', 'fenced')),
    holder      text        NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz,
    error       text,
    PRIMARY KEY (job, shard, slot)
);
CREATE INDEX pgfence_runs_recent ON pgfence_runs (started_at DESC);

-- +goose StatementBegin
CREATE FUNCTION pgfence_runs_protect() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: a succeeded run stays succeeded (job %, slot %)', OLD.job, OLD.slot
        USING ERRCODE = 'PF010';
END
$$;
-- +goose StatementEnd

CREATE TRIGGER pgfence_runs_protect BEFORE UPDATE ON pgfence_runs
    FOR EACH ROW WHEN (OLD.status = 'succeeded' AND NEW IS DISTINCT FROM OLD)
    EXECUTE FUNCTION pgfence_runs_protect();

-- A new leader resumes from the latest slot of its job and shard: deleting
-- that row (or truncating the ledger) would make finished slots run again.
-- Older rows may go (runner.Prune deletes them).
-- +goose StatementBegin
CREATE FUNCTION pgfence_runs_protect_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    latest timestamptz;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'pgfence: the run ledger is never truncated (finished slots would run again)'
            USING ERRCODE = 'PF010';
    END IF;
    EXECUTE format('SELECT max(slot) FROM %I.%I WHERE job = $1 AND shard = $2', TG_TABLE_SCHEMA, TG_TABLE_NAME)
        INTO latest USING OLD.job, OLD.shard;
    IF OLD.slot >= latest THEN
        RAISE EXCEPTION 'pgfence: the latest run of job %, shard % cannot be deleted (its slot would run again)', OLD.job, OLD.shard
            USING ERRCODE = 'PF010';
    END IF;
    RETURN OLD;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER pgfence_runs_protect_delete BEFORE DELETE ON pgfence_runs
    FOR EACH ROW EXECUTE FUNCTION pgfence_runs_protect_delete();
CREATE TRIGGER pgfence_runs_protect_truncate BEFORE TRUNCATE ON pgfence_runs
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence_runs_protect_delete();

-- Live runner instances, each with the sharded jobs it registered: a job's
-- shards are spread over the instances that list it. Rows of instances dead
-- for an hour are deleted by the living, through the expiry index.
CREATE TABLE pgfence_instances (
    id           text        PRIMARY KEY CHECK (octet_length(id) BETWEEN 1 AND 255),
    started_at   timestamptz NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    jobs         text[]      NOT NULL DEFAULT '{}'
);
CREATE INDEX pgfence_instances_expires ON pgfence_instances (expires_at);

-- +goose Down
DROP TABLE pgfence_instances;
DROP TABLE pgfence_runs;
DROP FUNCTION pgfence_runs_protect_delete();
DROP FUNCTION pgfence_runs_protect();
