// Package runner runs scheduled jobs on exactly one machine at a time, fenced.
//
// Every replica of an application builds a Runner, registers the same jobs
// ("compact the events table every 10 minutes", "charge subscriptions at
// 02:00 Europe/Paris") and calls Run. For each job one replica holds the
// job's lease (package lock) and runs its schedule slots; the others wait and
// take over within milliseconds of a graceful release, or within the lease
// TTL (plus one poll interval) when the leader dies or freezes.
//
// # Ledger
//
// Every attempt at a slot has a row in pgfence_runs: job, shard, kind
// (scheduled, or manual: asked for with RunNow), slot, attempt, token,
// status (pending, running, succeeded, failed, panicked, fenced, skipped),
// holder, times and error. A slot is
// claimed in a transaction guarded by the claimant's lease token; success is
// recorded in a guarded transaction conditioned on that token. Therefore a
// slot succeeds at most once, even if two replicas both believe they lead:
// the one with the older token is refused. A succeeded row can never change
// again (the schema refuses it).
//
// Jobs get a *Run with the slot, the token and guarded transactions:
// Run.RunTx for intermediate writes and Run.CommitTx for the final write, which
// records the slot's success in the same transaction so the job's effects and
// the ledger match one to one. A job whose lease is lost mid-run has its
// context cancelled and its later guarded writes refused; its slot is then
// claimed again (attempt + 1) by the next leader.
//
// # What is not guaranteed
//
//   - Writes that do not go through the run's guard (or a resource that
//     checks the token) are not fenced: a frozen leader can still make them.
//   - A slot whose effects are written outside CommitTx may have those
//     effects twice if its runner dies between the write and the success
//     record: the slot is retried. Make such effects idempotent.
//   - Slots are computed from each replica's clock; the ledger makes a slot
//     run once whatever the skew, but a replica with a wrong clock runs slots
//     at the wrong time.
//   - Slots missed while no replica ran: only the latest runs (RunLatest),
//     none (Skip), or the latest n, oldest first (CatchUp(n)); earlier ones
//     never run. Slots that pass while a long run is still going are not
//     queued; the latest due slot runs next.
//   - A job's very first start (no slot of it in the ledger yet) runs no
//     past slot under any policy, not even one that has just passed: its
//     first run is its next slot. "Missed" means missed since the job last
//     ran.
//
// # Sharded jobs
//
// RegisterSharded gives a job N shards, each with its own lease and token.
// Live instances heartbeat into pgfence_instances with the jobs they
// registered; each job's shards are spread over the live instances that
// registered that job only, so services with different jobs can share a
// schema. The assignment balances loads (no instance gets more than
// ceil(N/n) shards) and keeps each shard with the instance holding it while
// loads allow, spreading the rest by rendezvous hashing: a join moves only
// the newcomer's share, a leave only the leaver's shards. When an instance joins or leaves, owners release
// shards that are no longer theirs and new owners take them; a shard's lease
// ensures no two instances hold it at once. An instance starts its shard
// workers once its view of the members has held still for a moment, so
// replicas that start together do not all grab every shard first.
//
// # Singleton jobs spread
//
// Instances also list their singleton jobs in pgfence_instances, and each
// singleton job has a preferred instance: the same hashing, with loads
// bounded across all the jobs (at most ceil(1.25 x jobs/instances) each).
// Only the preferred instance campaigns for a job, so a fleet keeps one
// campaigner per job however many replicas it has (every waiting
// campaigner costs a share of its client's polls: with every replica
// campaigning, 1,000 jobs on ten replicas cost the server 25 times what
// they cost as single-shard jobs). A leader that is no longer preferred
// hands the job over between runs, once its term is a RebalanceInterval
// old (so that a job cannot bounce), and stops campaigning. After a crash,
// the crashed instance's jobs go to their next preferred instances when
// its liveness row expires (each balancer looks again just after the
// first other member's expiry), and are taken when their leases expire:
// within about a TTL. Singleton workers start campaigning once their
// instance's view has held still, as shard workers do.
//
// # Consumer groups
//
// RegisterConsumer adds work that never stops, split into partitions (an
// outbox relay, a stream consumer), consumed as a Kafka consumer group
// consumes a topic: each partition has one leader at a time among the
// replicas that register the group, spread and rebalanced as shards are,
// and Consumer.Consume runs for as long as this replica leads it. A
// partition's lease is "pgfence/group/" + group + "/" + partition. Its
// committed offset (pgfence_offsets; as in Kafka, the offset of the next
// item to read) is read when a term starts and committed by
// Partition.Commit in the same guarded transaction as the work's effects,
// conditioned on the token, so a stale leader's effects and progress are
// refused together and the next leader resumes at the committed offset.
// A rebalance or a shutdown ends Consume's context but lets a Commit under
// way finish before the lease is released. Wake wakes a partition's leader
// by NOTIFY; Consumer.Poll is the fallback. Seek sets an offset through the
// partition's fence. Partitions (and `pgfence groups`) list offsets, lag
// and leaders; Terms lists the leadership terms of jobs and partitions,
// with why each ended (pgfence_terms).
//
// # Leases and the ledger's upkeep
//
// Every job and shard campaigns through lock.Election, with the lease
// settings of the lock client given to New. The lease of a job is named
// "pgfence/job/" + its name, and that of a shard "pgfence/job/" + name + "/"
// + shard (from 0), so `pgfence leases` shows who leads each job and with
// which token; a lease's holder is the leading instance's id (the client's
// Holder). Runs and Prune read and trim the ledger; every runner prunes runs
// older than Config.Retention hourly. A permanent database error stops Run
// (see package lock for which errors are permanent); failed runs are logged
// at ERROR and fenced ones at WARN, with job, shard, slot, attempt and
// token. Metrics (runs by status, durations, retries, leadership changes,
// shards owned, missed slots) go to the client's MeterProvider, with the job
// as the only attribute.
package runner
