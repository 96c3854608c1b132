-- The roles runners have registered, with their partition count: the
-- first runner to register a role sets it, and a runner that gives
-- another count is refused (runner.ErrPartitionCount) instead of leaving
-- the partitions it does not know of without a leader. A position's
-- advanced_at moves only when the position does; committed_at is its last
-- Commit, moved or not; head is the newest position available as the
-- role's Head last reported it (head_at), for the partition's lag.

-- +goose Up
CREATE TABLE pgfence_roles (
    role          text        PRIMARY KEY,
    partitions    integer     NOT NULL CHECK (partitions BETWEEN 1 AND 65536),
    registered_at timestamptz NOT NULL,
    registered_by text        NOT NULL
);
ALTER TABLE pgfence_positions ADD COLUMN committed_at timestamptz,
    ADD COLUMN head bigint, ADD COLUMN head_at timestamptz;

-- +goose Down
ALTER TABLE pgfence_positions DROP COLUMN committed_at, DROP COLUMN head, DROP COLUMN head_at;
DROP TABLE pgfence_roles;
