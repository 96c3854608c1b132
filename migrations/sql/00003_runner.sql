-- The runner's run ledger and its live instances.

-- +goose Up
-- One row per attempt at a slot of a job (and shard; unsharded jobs use
-- shard 0). A scheduled slot is the schedule's time; a manual run (kind
-- 'manual', asked for with pgfence jobs run) is the time it was asked for,
-- and waits as a 'pending' row with no token until its job's leader claims
-- it. Each attempt carries its lease token. Success is recorded in a
-- transaction fenced by that token and conditioned on it, so a zombie's
-- late success is refused; a succeeded row never changes again (trigger
-- below). An attempt still 'running' under an older token when a newer
-- leader claims the slot is marked 'fenced' by that claim. Slots that fall
-- due while their job is paused are recorded as 'skipped'.
CREATE TABLE pgfence_runs (
    job          text        NOT NULL,
    shard        integer     NOT NULL CHECK (shard >= 0),
    kind         text        NOT NULL CHECK (kind IN ('scheduled', 'manual')),
    slot         timestamptz NOT NULL,
    attempt      integer     NOT NULL CHECK (attempt >= 1),
    token        bigint      CHECK (token >= 1),
    status       text        NOT NULL
                 CHECK (status IN ('pending', 'running', 'succeeded', 'failed', 'panicked', 'fenced', 'skipped')),
    holder       text        NOT NULL,
    requested_by text,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz,
    error        text,
    PRIMARY KEY (job, shard, kind, slot, attempt),
    CHECK ((status = 'pending') = (token IS NULL))
);
CREATE INDEX pgfence_runs_recent ON pgfence_runs (started_at DESC);
-- Manual runs not yet started, which every heartbeat looks for (a leader
-- whose connection cannot LISTEN, behind PgBouncer, learns of them so).
CREATE INDEX pgfence_runs_pending ON pgfence_runs (job, shard) WHERE status = 'pending';

-- The jobs runners have registered, with what an operator set: paused_at
-- (NULL: not paused) stops every replica from starting the job's scheduled
-- slots, from its next slot on, until resumed. Runners register their jobs
-- when they start, keeping the pause.
CREATE TABLE pgfence_jobs (
    job           text        PRIMARY KEY,
    schedule      text        NOT NULL,
    shards        integer     NOT NULL CHECK (shards >= 0),
    max_attempts  integer     NOT NULL CHECK (max_attempts >= 1),
    registered_at timestamptz NOT NULL,
    registered_by text        NOT NULL,
    paused_at     timestamptz,
    paused_by     text
);

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

-- A new leader resumes from the latest scheduled slot of its job and
-- shard: deleting that slot's rows (or truncating the ledger) would make
-- finished slots run again.
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
    IF OLD.kind <> 'scheduled' THEN
        RETURN OLD;
    END IF;
    EXECUTE format('SELECT max(slot) FROM %I.%I WHERE job = $1 AND shard = $2 AND kind = ''scheduled''',
                   TG_TABLE_SCHEMA, TG_TABLE_NAME)
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

-- Live runner instances, each with the jobs it registered: a job's shards,
-- and the preferred leaders of singleton jobs, are spread over the
-- instances that list it. Rows of instances dead
-- for an hour are deleted by the living, through the expiry index.
CREATE TABLE pgfence_instances (
    id           text        PRIMARY KEY CHECK (octet_length(id) BETWEEN 1 AND 255),
    started_at   timestamptz NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    jobs         text[]      NOT NULL DEFAULT '{}',
    -- Set by a clean stop (Run returning), cleared by the next heartbeat:
    -- a stopped instance is told apart from one that crashed.
    stopped_at   timestamptz
);
CREATE INDEX pgfence_instances_expires ON pgfence_instances (expires_at);

-- +goose Down
DROP TABLE pgfence_instances;
DROP TABLE pgfence_jobs;
DROP TABLE pgfence_runs;
DROP FUNCTION pgfence_runs_protect_delete();
DROP FUNCTION pgfence_runs_protect();
