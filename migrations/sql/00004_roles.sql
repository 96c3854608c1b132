-- The roles runners have registered, with their partition count: the
-- first runner to register a role sets it, and a runner that gives
-- another count is refused (runner.ErrPartitionCount) instead of leaving
-- the partitions it does not know of without a leader.

-- +goose Up
CREATE TABLE pgfence_roles (
    role          text        PRIMARY KEY,
    partitions    integer     NOT NULL CHECK (partitions BETWEEN 1 AND 65536),
    registered_at timestamptz NOT NULL,
    registered_by text        NOT NULL
);

-- +goose Down
DROP TABLE pgfence_roles;
