-- pgfence runner: the run ledger and the live runner instances.

-- +goose Up
-- One row per (job, shard, slot). The token is the fencing token of the
-- attempt that last claimed the slot; success is recorded in a transaction
-- guarded by that token and conditioned on it, so a zombie's late success is
-- refused. Unsharded jobs use shard 0.
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

-- Success is final: no later attempt, zombie or operator through the library
-- can turn it back into something else.
CREATE TRIGGER pgfence_runs_protect BEFORE UPDATE ON pgfence_runs
    FOR EACH ROW WHEN (OLD.status = 'succeeded' AND NEW IS DISTINCT FROM OLD)
    EXECUTE FUNCTION pgfence_runs_protect();

-- Live runner instances, for spreading the shards of sharded jobs.
CREATE TABLE pgfence_instances (
    id           text        PRIMARY KEY CHECK (octet_length(id) BETWEEN 1 AND 255),
    started_at   timestamptz NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL
);

-- +goose Down
DROP TABLE pgfence_instances;
DROP TABLE pgfence_runs;
DROP FUNCTION pgfence_runs_protect();
