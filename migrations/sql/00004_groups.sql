-- Consumer groups (runner.Consumer) and the leadership terms of every
-- runner lease.

-- +goose Up

-- The consumer groups runners have registered, with their partition
-- count: the first runner to register a group sets it, and a runner that
-- gives another count is refused (runner.ErrPartitionCount) instead of
-- leaving the partitions it does not know of without a leader. While the
-- count changes (runner.SetPartitions with replicas running), the new
-- count is next_partitions and the cut is cut_offset: the partitions of the
-- current count consume below the cut (until_offset of their offsets),
-- those of the next count from it.
CREATE TABLE pgfence_groups (
    group_name      text        PRIMARY KEY,
    partitions      integer     NOT NULL CHECK (partitions BETWEEN 1 AND 65536),
    registered_at   timestamptz NOT NULL,
    registered_by   text        NOT NULL,
    next_partitions integer     CHECK (next_partitions BETWEEN 1 AND 65536),
    cut_offset      bigint,
    change_at       timestamptz,
    change_by       text,
    CHECK ((next_partitions IS NULL) = (cut_offset IS NULL))
);

-- The committed offset of each partition of a consumer group: the offset
-- of the next item to read (an outbox id, a stream offset, an LSN). A
-- partition's leader advances it in the same transaction as the work's
-- effects, guarded by its lease token, so a zombie's progress and effects
-- are refused together; token is the lease token of the last advance, and
-- never goes down (trigger below), nor does a row change its key.
-- advanced_at moves only when the offset does; committed_at is the last
-- Commit, moved or not; end_offset is the partition's end offset as the
-- group's End last reported it (end_at), for the lag. until_offset caps
-- the offset while the group's partition count changes (the cut), and for
-- good on a partition the change dropped.
CREATE TABLE pgfence_offsets (
    group_name       text        NOT NULL,
    partition        integer     NOT NULL CHECK (partition >= 0),
    committed_offset bigint      NOT NULL DEFAULT 0,
    token            bigint      NOT NULL DEFAULT 0 CHECK (token >= 0),
    holder           text,
    advanced_at      timestamptz,
    committed_at     timestamptz,
    commits          bigint      NOT NULL DEFAULT 0,
    end_offset       bigint,
    end_at           timestamptz,
    until_offset     bigint,
    PRIMARY KEY (group_name, partition)
);

-- +goose StatementBegin
CREATE FUNCTION pgfence_offsets_protect() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.group_name <> OLD.group_name OR NEW.partition <> OLD.partition THEN
        RAISE EXCEPTION 'pgfence: an offset keeps its group and partition (%, %)', OLD.group_name, OLD.partition
            USING ERRCODE = 'PF010';
    END IF;
    IF NEW.token < OLD.token THEN
        RAISE EXCEPTION 'pgfence: offset of %/% is held by token %, refusing token %', OLD.group_name, OLD.partition, OLD.token, NEW.token
            USING ERRCODE = 'PF010';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER pgfence_offsets_protect BEFORE UPDATE ON pgfence_offsets
    FOR EACH ROW EXECUTE FUNCTION pgfence_offsets_protect();

-- The leadership terms of the runner's leases, for operators: who led a
-- job's shard (kind 'job'; a singleton job's shard is 0) or a consumer
-- group's partition (kind 'group') with which token, from when to when,
-- and why the term ended (end_cause: released, moved, handed_over,
-- shutdown, lease_lost, failed; revoked by a seek or a change of the
-- partition count; expired when its leader could not say: killed, frozen
-- past its lease, cut off). The leader writes the row when
-- its term starts and closes it before releasing the lease; the next
-- leader closes an earlier term left open. Pruned with the ledger.
CREATE TABLE pgfence_terms (
    kind       text        NOT NULL CHECK (kind IN ('job', 'group')),
    name       text        NOT NULL,
    shard      integer     NOT NULL CHECK (shard >= 0),
    token      bigint      NOT NULL,
    holder     text        NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at   timestamptz,
    end_cause  text,
    PRIMARY KEY (kind, name, shard, token),
    CHECK ((ended_at IS NULL) = (end_cause IS NULL))
);
CREATE INDEX pgfence_terms_started ON pgfence_terms (started_at);

-- +goose Down
DROP TABLE pgfence_terms;
DROP TABLE pgfence_offsets;
DROP FUNCTION pgfence_offsets_protect();
DROP TABLE pgfence_groups;
