-- Shard membership is per job: an instance row lists the sharded jobs the
-- instance registered, and each job's shards are spread only over the live
-- instances that list it (two services with different jobs can share the
-- schema). Rows of instances dead for an hour are deleted by the heartbeats
-- of the living, which find them through the expiry index.

-- +goose Up
ALTER TABLE pgfence_instances ADD COLUMN jobs text[] NOT NULL DEFAULT '{}';
CREATE INDEX pgfence_instances_expires ON pgfence_instances (expires_at);

-- +goose Down
DROP INDEX pgfence_instances_expires;
ALTER TABLE pgfence_instances DROP COLUMN jobs;
