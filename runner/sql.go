package runner

import (
	"fmt"
	"sync"

	"github.com/pgfence/pgfence/internal/ident"
)

// Lease and wake names: a job's lease is jobLeasePrefix+NAME (a shard's
// jobLeasePrefix+NAME+"/"+SHARD); a manual run is announced to the job's
// (shard's) leader as a release of runWakePrefix+NAME (+"/"+SHARD).
const (
	jobLeasePrefix = "pgfence/job/"
	runWakePrefix  = "pgfence/run/"
)

// queries is the runner's SQL for one schema, by concern: a leader's
// ledger of attempts, the fleet's membership, and the operators' steering
// and reading. It is built once per schema (sqlFor). The fenced ledger
// statements are functions of the fence expression (fence.Guard.Fold),
// built once per leadership term; each numbers its own parameters first,
// and the fold's two come after them.
type queries struct {
	ledgerSQL
	fleetSQL
	controlSQL
	groupSQL
}

type ledgerSQL struct {
	claimFirst, claim, succeedFenced, fail func(fence string) string

	succeed, markFenced, outcome, lastSlot, ranBetween, requested string
}

type fleetSQL struct {
	register, registerGroups, heartbeat, announce, leave, holders, instances, terms, termStart, termEnd string
}

type groupSQL struct {
	offset, advance, afterAdvance, end, partitions, seek, groupCounts, groups string
	// A count change (SetPartitions with replicas running, then its end).
	lockGroup, createOffsets, cutAt, setCut, drained, switchCount, groupAnnounce, groupLeases, cancelCut, boundTx, changing string
}

type controlSQL struct {
	prune, runs, pause, resume, jobShards, request, waitRun, jobs, liveMembers, setCount string
}

// built holds each schema's statements, built on first use: operators'
// calls (Jobs, Runs, Pause, ...) take a schema each time.
var built sync.Map // validated schema → *queries

// sqlFor returns schema's statements; schema must be validated.
func sqlFor(schema string) *queries {
	schema = ident.Schema(schema) // "" and "pgfence" are one schema
	if q, ok := built.Load(schema); ok {
		return q.(*queries)
	}
	q, _ := built.LoadOrStore(schema, &queries{newLedgerSQL(schema), newFleetSQL(schema), newControlSQL(schema), newGroupSQL(schema)})
	return q.(*queries)
}

// tables are schema's tables and functions, quoted.
type tables struct {
	runs, jobs, inst, leases, wake, offsets, groups, terms string
}

func tablesOf(schema string) tables {
	return tables{
		runs:    ident.Table(schema, "pgfence_runs"),
		jobs:    ident.Table(schema, "pgfence_jobs"),
		inst:    ident.Table(schema, "pgfence_instances"),
		leases:  ident.Table(schema, "pgfence_lease_states"), // read only: held while holder IS NOT NULL AND expires_at > now()
		wake:    ident.Table(schema, "pgfence_wake_waiters"),
		offsets: ident.Table(schema, "pgfence_offsets"),
		groups:  ident.Table(schema, "pgfence_groups"),
		terms:   ident.Table(schema, "pgfence_terms"),
	}
}

// newGroupSQL: consumer groups' offsets.
func newGroupSQL(schema string) groupSQL {
	t := tablesOf(schema)
	return groupSQL{
		// A partition's committed offset ($1 group, $2 partition), its row
		// created at 0 the first time: one row either way (the inserted
		// row is not visible to the second branch, which finds an
		// existing one).
		offset: `WITH ins AS (INSERT INTO ` + t.offsets + ` (group_name, partition) VALUES ($1, $2)
    ON CONFLICT DO NOTHING RETURNING committed_offset, until_offset)
SELECT x.committed_offset, x.until_offset, (SELECT g.partitions FROM ` + t.groups + ` g WHERE g.group_name = $1)
  FROM (SELECT committed_offset, until_offset FROM ins
        UNION ALL SELECT committed_offset, until_offset FROM ` + t.offsets + ` WHERE group_name = $1 AND partition = $2) x`,

		// Advances a partition's offset from $6 to $3 inside its leader's
		// guarded transaction (token $4, holder $5), with when it last
		// moved (advanced_at, only if it does) and was committed: a
		// compare-and-set, so an offset that moved (an earlier commit
		// whose answer was lost did commit) is not advanced twice, and
		// never past the cut of a count change (until_offset: the row's
		// own column, so that a change committed while this statement
		// waited for the row is seen when the row is re-checked). The
		// guard has checked the token and holds the lease row until the
		// end of the transaction; the token condition and the trigger
		// refuse a token going down.
		advance: `UPDATE ` + t.offsets + ` SET committed_offset = $3, token = $4, holder = $5,
    advanced_at = CASE WHEN committed_offset <> $3 THEN now() ELSE advanced_at END, committed_at = now(), commits = commits + 1
 WHERE group_name = $1 AND partition = $2 AND token <= $4 AND committed_offset = $6
   AND (until_offset IS NULL OR $3 <= until_offset)`,

		// Why an advance matched no row: the offset and the cut now.
		afterAdvance: `SELECT committed_offset, until_offset FROM ` + t.offsets + ` WHERE group_name = $1 AND partition = $2`,

		// Records the end offset ($3) the group's End reported for
		// partition $2 of group $1: informational, for the lag shown to
		// operators; no fence needed.
		end: `UPDATE ` + t.offsets + ` SET end_offset = $3, end_at = now() WHERE group_name = $1 AND partition = $2`,

		// Every partition that has had a leader (of group $2, or of all
		// when $2 is ''), with its lease ($1 the group lease prefix): a
		// lease not held was last held until its expires_at (its
		// session's expiry, or the time it was freed).
		partitions: `SELECT p.group_name, p.partition, p.committed_offset, p.token, coalesce(p.holder, ''), p.advanced_at, p.committed_at, p.commits,
       p.end_offset, p.end_at,
       coalesce(l.holder, ''), coalesce(l.token, 0), coalesce(l.holder IS NOT NULL AND l.expires_at > now(), false),
       CASE WHEN NOT (l.holder IS NOT NULL AND l.expires_at > now()) THEN l.expires_at END, now()
  FROM ` + t.offsets + ` p
  LEFT JOIN ` + t.leases + ` l ON l.name = $1 || p.group_name || '/' || p.partition
 WHERE $2 = '' OR p.group_name = $2
 ORDER BY p.group_name, p.partition`,

		// Sets the offset of partition $2 of group $1 to $3 with the
		// revoking token $4 (by $5), in the transaction that revoked the
		// partition's lease; closes the term it ended (as revoked; an
		// older one left open, as expired) and returns the offset before.
		// The partition counts of groups $1 now, and the next ones (0: no
		// change under way).
		groupCounts: `SELECT group_name, partitions, coalesce(next_partitions, 0) FROM ` + t.groups + ` WHERE group_name = ANY($1)`,

		// Every group (or group $1), with its count change under way if
		// any, and how many of its partitions have reached the cut.
		groups: `SELECT g.group_name, g.partitions, g.registered_at, g.registered_by, coalesce(g.next_partitions, 0),
       coalesce(g.cut_offset, 0), g.change_at, coalesce(g.change_by, ''),
       (SELECT count(*) FROM ` + t.offsets + ` o WHERE o.group_name = g.group_name AND o.partition < g.partitions
           AND g.cut_offset IS NOT NULL AND o.committed_offset >= g.cut_offset), now()
  FROM ` + t.groups + ` g WHERE $1 = '' OR g.group_name = $1 ORDER BY g.group_name`,

		// A count change, in one transaction: lock group $1's row, and
		// return its count and the change under way.
		lockGroup: `SELECT partitions, coalesce(next_partitions, 0), coalesce(cut_offset, 0), coalesce(change_by, '')
  FROM ` + t.groups + ` WHERE group_name = $1 FOR UPDATE`,
		// The offsets of partitions 0 to $2-1 of group $1, created at 0
		// where missing.
		createOffsets: `INSERT INTO ` + t.offsets + ` (group_name, partition)
SELECT $1, p FROM generate_series(0, $2 - 1) AS p ON CONFLICT DO NOTHING`,
		// The cut: the highest offset of partitions 0 to $2-1, their rows
		// locked (a Commit under way finishes first; one that comes after
		// sees the cut).
		cutAt: `WITH l AS (SELECT committed_offset FROM ` + t.offsets + ` WHERE group_name = $1 AND partition < $2 FOR UPDATE)
SELECT coalesce(max(committed_offset), 0) FROM l`,
		// Caps partitions 0 to $2-1 at the cut $3, and records the change
		// to $4 partitions (by $5).
		setCut: `WITH o AS (UPDATE ` + t.offsets + ` SET until_offset = $3::bigint WHERE group_name = $1 AND partition < $2::int)
UPDATE ` + t.groups + ` SET next_partitions = $4, cut_offset = $3::bigint, change_at = now(), change_by = $5 WHERE group_name = $1`,
		// Ends the change of group $1 under way without switching: the
		// current partitions lose their cut.
		cancelCut: `WITH o AS (UPDATE ` + t.offsets + ` SET until_offset = NULL WHERE group_name = $1 AND partition < $2::int)
UPDATE ` + t.groups + ` SET next_partitions = NULL, cut_offset = NULL, change_at = NULL, change_by = NULL WHERE group_name = $1`,
		// The lease names of every partition of group $1 that has ever
		// had a leader ($2: the group lease prefix).
		groupLeases: `SELECT coalesce(array_agg($2::text || group_name || '/' || partition), '{}') FROM ` + t.offsets + ` WHERE group_name = $1`,
		// Bounds the waits and the idle time of the transaction it runs
		// in ($1, as a PostgreSQL interval): a switch holds lease rows
		// that the holders' renewals need.
		boundTx: `SELECT set_config('lock_timeout', $1, true), set_config('idle_in_transaction_session_timeout', $1, true)`,
		// Whether group $1's count is changing, its row shared (a switch
		// waits for the caller's transaction, and the caller for it).
		changing: `SELECT next_partitions IS NOT NULL FROM ` + t.groups + ` WHERE group_name = $1 FOR SHARE`,
		// How many of partitions 0 to $2-1 are still below the cut $3.
		drained: `SELECT count(*) FROM ` + t.offsets + ` WHERE group_name = $1 AND partition < $2 AND committed_offset < $3`,
		// The switch to the next count $2 at the cut $3, once the leases
		// are revoked: the partitions of the next count start at the cut,
		// uncapped; those dropped stay capped at it; the terms revoked are
		// closed as such.
		switchCount: `WITH t AS (UPDATE ` + t.terms + ` x SET ended_at = now(), end_cause = CASE WHEN x.token = (SELECT max(y.token)
        FROM ` + t.terms + ` y WHERE y.kind = 'group' AND y.name = $1 AND y.shard = x.shard) THEN 'revoked' ELSE 'expired' END
    WHERE x.kind = 'group' AND x.name = $1 AND x.ended_at IS NULL),
o AS (UPDATE ` + t.offsets + `
    SET committed_offset = $3::bigint, until_offset = CASE WHEN partition < $2::int THEN NULL ELSE $3::bigint END
  WHERE group_name = $1)
UPDATE ` + t.groups + ` SET partitions = $2::int, next_partitions = NULL, cut_offset = NULL,
    registered_at = now(), registered_by = coalesce(change_by, registered_by), change_at = NULL, change_by = NULL
 WHERE group_name = $1`,
		// Wakes the leaders of partitions 0 to $2-1 of group $1 ($3: the
		// wake names' prefix) and announces a change of members ($4), so
		// that every balancer looks at once.
		groupAnnounce: fmt.Sprintf(`SELECT %[1]s($3::text || $1::text || '/' || p) FROM generate_series(0, $2::int - 1) AS p
UNION ALL SELECT %[1]s($4)`, ident.Table(schema, "pgfence_wake_waiters")),

		seek: `WITH old AS (SELECT committed_offset FROM ` + t.offsets + ` WHERE group_name = $1 AND partition = $2 FOR UPDATE),
term AS (UPDATE ` + t.terms + ` x SET ended_at = now(), end_cause = CASE WHEN x.token = (SELECT max(y.token) FROM ` + t.terms + ` y
        WHERE y.kind = 'group' AND y.name = $1 AND y.shard = $2) THEN 'revoked' ELSE 'expired' END
    WHERE x.kind = 'group' AND x.name = $1 AND x.shard = $2 AND x.token < $4 AND x.ended_at IS NULL)
UPDATE ` + t.offsets + ` o SET committed_offset = $3, token = $4, holder = $5,
    advanced_at = CASE WHEN o.committed_offset <> $3 THEN now() ELSE o.advanced_at END, committed_at = now(), commits = o.commits + 1
  FROM old WHERE o.group_name = $1 AND o.partition = $2
RETURNING old.committed_offset`,
	}
}

// newLedgerSQL: a leader's claims and outcomes of attempts.
func newLedgerSQL(schema string) ledgerSQL {
	t := tablesOf(schema)
	runs, jobs := t.runs, t.jobs
	// The attempt a statement is about: $1 job, $2 shard, $3 kind, $4 slot,
	// $5 attempt, $6 token.
	const attempt = `job = $1::text AND shard = $2::int AND kind = $3::text AND slot = $4::timestamptz
   AND attempt = $5::int AND token = $6::bigint AND status = 'running'`
	return ledgerSQL{
		// The common case of a claim, in one plain statement: the first
		// attempt at a scheduled slot of a job that is not paused ($1 job,
		// $2 shard, $3 slot, $4 token, $5 holder; its fence after them).
		// No row when the slot has an attempt already or the job is
		// paused: claim then decides.
		claimFirst: func(fence string) string {
			return `INSERT INTO ` + runs + ` (job, shard, kind, slot, attempt, token, status, holder, started_at)
SELECT $1, $2, 'scheduled', $3, 1, $4, 'running', $5, now() FROM (SELECT ` + fence + `) AS fence
 WHERE NOT EXISTS (SELECT 1 FROM ` + jobs + ` WHERE job = $1 AND paused_at IS NOT NULL)
ON CONFLICT DO NOTHING
RETURNING attempt`
		},

		// Carries its own fence (after its seven parameters: $1 job, $2
		// shard, $3 kind, $4 slot, $5 token, $6 holder, $7 max attempts):
		// one autocommitted statement, refused if the lease moved on. It
		// starts an attempt (returning its number and status) when the
		// slot is a manual run still pending, or a scheduled slot never
		// claimed, or its latest attempt was fenced, is still "running"
		// under an older token (its runner died or was paused: that
		// attempt is marked fenced), or failed with attempts left. A
		// scheduled slot's attempt is recorded as skipped ("paused") while
		// the job is paused. It returns no row for a finished slot.
		claim: func(fence string) string {
			return `WITH f AS MATERIALIZED (SELECT ` + fence + `),
last AS (
    SELECT attempt, status, token, requested_by FROM ` + runs + `
     WHERE job = $1::text AND shard = $2::int AND kind = $3::text AND slot = $4::timestamptz
     ORDER BY attempt DESC LIMIT 1),
st AS (
    SELECT CASE WHEN $3::text = 'scheduled' AND EXISTS (SELECT 1 FROM ` + jobs + ` WHERE job = $1::text AND paused_at IS NOT NULL)
                THEN 'skipped' ELSE 'running' END AS status),
took AS (
    UPDATE ` + runs + ` r SET status = 'running', token = $5::bigint, holder = $6::text, started_at = now()
      FROM last, f
     WHERE last.status = 'pending' AND r.job = $1::text AND r.shard = $2::int AND r.kind = $3::text
       AND r.slot = $4::timestamptz AND r.attempt = last.attempt
    RETURNING r.attempt, r.status),
zombie AS (
    UPDATE ` + runs + ` r SET status = 'fenced', finished_at = now(), error = 'taken over by token ' || $5::bigint
      FROM last, f
     WHERE last.status = 'running' AND last.token < $5::bigint AND r.job = $1::text AND r.shard = $2::int
       AND r.kind = $3::text AND r.slot = $4::timestamptz AND r.attempt = last.attempt AND r.status = 'running'),
ins AS (
    INSERT INTO ` + runs + ` (job, shard, kind, slot, attempt, token, status, holder, requested_by, started_at, finished_at, error)
    SELECT $1::text, $2::int, $3::text, $4::timestamptz, coalesce(last.attempt, 0) + 1, $5::bigint, st.status, $6::text,
           last.requested_by, now(),
           CASE WHEN st.status = 'skipped' THEN now() END, CASE WHEN st.status = 'skipped' THEN 'paused' END
      FROM f CROSS JOIN st LEFT JOIN last ON true
     WHERE (last.attempt IS NULL AND $3::text = 'scheduled')
        OR last.status = 'fenced'
        OR (last.status = 'running' AND last.token < $5::bigint)
        OR (last.status IN ('failed', 'panicked') AND last.attempt < $7::int)
    RETURNING attempt, status)
SELECT attempt, status FROM took UNION ALL SELECT attempt, status FROM ins`
		},

		// Fenced (in CommitTx's guarded transaction, or by a folded check
		// of its own) and conditioned on the attempt and its token: a
		// zombie's late outcome changes nothing.
		succeed: `UPDATE ` + runs + ` SET status = 'succeeded', finished_at = now()
 WHERE ` + attempt,
		succeedFenced: func(fence string) string {
			return `UPDATE ` + runs + ` SET status = 'succeeded', finished_at = now() FROM (SELECT ` + fence + `) AS fence
 WHERE ` + attempt
		},
		// $7 is 'failed' or 'panicked', $8 the error text.
		fail: func(fence string) string {
			return `UPDATE ` + runs + ` SET status = $7::text, finished_at = now(), error = $8::text FROM (SELECT ` + fence + `) AS fence
 WHERE ` + attempt
		},

		// Not guarded (the lease is gone) but conditioned on the attempt
		// and its token: it only marks this attempt's own row.
		markFenced: `UPDATE ` + runs + ` SET status = 'fenced', finished_at = now(), error = $7::text
 WHERE ` + attempt,

		// What the ledger holds for an attempt ($1 job ... $6 token), when
		// the statement recording its outcome did not say.
		outcome: `SELECT status FROM ` + runs + ` WHERE job = $1::text AND shard = $2::int AND kind = $3::text
   AND slot = $4::timestamptz AND attempt = $5::int AND token = $6::bigint`,

		lastSlot: `SELECT (SELECT max(slot) FROM ` + runs + ` WHERE job = $1 AND shard = $2 AND kind = 'scheduled'),
       (SELECT finished_at FROM ` + runs + ` WHERE job = $1 AND shard = $2 AND kind = 'scheduled' AND status = 'succeeded'
         ORDER BY slot DESC LIMIT 1)`,
		// How many scheduled slots in [$3, $4) of a job's shard some
		// replica has an attempt at: those a late leader passes over were
		// not missed.
		ranBetween: `SELECT count(DISTINCT slot) FROM ` + runs + `
 WHERE job = $1 AND shard = $2 AND kind = 'scheduled' AND slot >= $3 AND slot < $4`,

		// The manual runs of a job's shard that its leader (token $3,
		// max attempts $4) should start: pending, or whose latest attempt
		// a claim would take up again. Oldest first.
		requested: `SELECT slot FROM (
    SELECT DISTINCT ON (slot) slot, attempt, status, token FROM ` + runs + `
     WHERE job = $1 AND shard = $2 AND kind = 'manual'
     ORDER BY slot, attempt DESC) AS latest
 WHERE status IN ('pending', 'fenced') OR (status = 'running' AND token < $3)
    OR (status IN ('failed', 'panicked') AND attempt < $4)
 ORDER BY slot`,
	}
}

// newFleetSQL: the instances' heartbeats and membership, and the
// operators' view of them.
func newFleetSQL(schema string) fleetSQL {
	t := tablesOf(schema)
	runs, jobs, inst, leases, wake, groups := t.runs, t.jobs, t.inst, t.leases, t.wake, t.groups
	return fleetSQL{
		// Registers this instance's jobs ($1 names, $2 schedules, $3 shard
		// counts, $4 max attempts, by $5), keeping a pause.
		register: `INSERT INTO ` + jobs + ` (job, schedule, shards, max_attempts, registered_at, registered_by)
SELECT j, s, n, a, now(), $5 FROM unnest($1::text[], $2::text[], $3::int[], $4::int[]) AS t(j, s, n, a)
ON CONFLICT (job) DO UPDATE SET schedule = EXCLUDED.schedule, shards = EXCLUDED.shards,
   max_attempts = EXCLUDED.max_attempts, registered_at = now(), registered_by = EXCLUDED.registered_by`,

		// Registers this instance's groups ($1 names, $2 partition counts,
		// by $3): the first registration sets a group's count; each row
		// comes back with the count registered (the no-op update locks
		// and returns the committed row, also when another instance
		// registered it concurrently).
		registerGroups: `INSERT INTO ` + groups + ` AS r (group_name, partitions, registered_at, registered_by)
SELECT n, p, now(), $3 FROM unnest($1::text[], $2::int[]) AS t(n, p)
ON CONFLICT (group_name) DO UPDATE SET partitions = r.partitions
RETURNING group_name, partitions, coalesce(next_partitions, 0), registered_at, registered_by`,

		// Renews this instance's row (with the jobs it runs),
		// deletes rows of instances dead for longer than $4, and returns
		// the live instances with their jobs; this instance's own row also
		// carries the (job, shard) pairs of the schema's pending manual
		// runs, through the partial index.
		heartbeat: fmt.Sprintf(`WITH me AS (
    INSERT INTO %[1]s AS i (id, started_at, heartbeat_at, expires_at, jobs)
    VALUES ($1, now(), now(), now() + $2 * interval '1 microsecond', $3)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at, jobs = EXCLUDED.jobs,
        started_at = CASE WHEN $5 THEN now() ELSE i.started_at END, stopped_at = NULL
    RETURNING id, jobs),
gone AS (DELETE FROM %[1]s WHERE expires_at < now() - $4 * interval '1 microsecond' AND id <> $1),
pending AS (SELECT DISTINCT job, shard FROM %[2]s WHERE status = 'pending')
SELECT id, jobs, NULL::text[], NULL::int[], (extract(epoch FROM expires_at - now()) * 1e6)::bigint
  FROM %[1]s WHERE expires_at > now() AND id <> $1
UNION ALL
SELECT id, jobs, (SELECT array_agg(job) FROM pending), (SELECT array_agg(shard) FROM pending), NULL FROM me`, inst, runs),
		// Announces a change of members (a join, or with leave a graceful
		// leave) to every runner of the schema, on the channel blocked
		// acquirers listen to, as a release of the pseudo-lease $1.
		announce: fmt.Sprintf(`SELECT %[1]s($1)`, wake),

		// Who holds each of the leases $1 now (unexpired), through the
		// primary key.
		holders: `SELECT name, holder FROM ` + leases + ` WHERE name = ANY($1) AND holder IS NOT NULL AND expires_at > now()`,
		leave: fmt.Sprintf(`WITH gone AS (UPDATE %[1]s SET expires_at = now(), stopped_at = now() WHERE id = $1 RETURNING id)
SELECT %[2]s($2) FROM gone`, inst, wake),

		// Every instance row ($1 the job lease prefix) with the job
		// leases it holds, unexpired: parallel arrays of job, shard and
		// token.
		instances: `SELECT i.id, i.started_at, i.heartbeat_at, i.expires_at, i.expires_at > now(), i.stopped_at, i.jobs,
       coalesce(array_agg(h.job ORDER BY h.job, h.shard) FILTER (WHERE h.job IS NOT NULL), '{}'),
       coalesce(array_agg(h.shard ORDER BY h.job, h.shard) FILTER (WHERE h.job IS NOT NULL), '{}'),
       coalesce(array_agg(h.token ORDER BY h.job, h.shard) FILTER (WHERE h.job IS NOT NULL), '{}'),
       rp.groups, rp.parts, rp.tokens, now()
  FROM ` + inst + ` i
  LEFT JOIN LATERAL (
         SELECT j.job, g.shard, l.token
           FROM ` + jobs + ` j, generate_series(0, greatest(j.shards, 1) - 1) AS g(shard), ` + leases + ` l
          WHERE l.name = $1 || j.job || CASE WHEN j.shards = 0 THEN '' ELSE '/' || g.shard END
            AND l.holder = i.id AND l.expires_at > now()) AS h ON true
  LEFT JOIN LATERAL (
         SELECT coalesce(array_agg(r.group_name ORDER BY r.group_name, g.p), '{}') AS groups,
                coalesce(array_agg(g.p ORDER BY r.group_name, g.p), '{}') AS parts,
                coalesce(array_agg(l.token ORDER BY r.group_name, g.p), '{}') AS tokens
           FROM ` + groups + ` r CROSS JOIN LATERAL generate_series(0, r.partitions - 1) AS g(p)
           JOIN ` + leases + ` l ON l.name = $2 || r.group_name || '/' || g.p
          WHERE l.holder = i.id AND l.expires_at > now()) AS rp ON true
 GROUP BY i.id, i.started_at, i.heartbeat_at, i.expires_at, i.stopped_at, i.jobs, rp.groups, rp.parts, rp.tokens
 ORDER BY i.id`,

		// The latest $1 leadership terms of kind $3 (of name $2, or of
		// all when $2 is ''), newest first: the terms recorded, with
		// their attempts in the ledger, and the ledger's terms whose
		// record is missing (its start could not be written).
		terms: `WITH t AS (SELECT name, shard, token, holder, started_at, ended_at, end_cause FROM ` + t.terms + `
    WHERE kind = $3 AND ($2 = '' OR name = $2)),
r AS (SELECT job, shard, token, min(holder) AS holder, min(started_at) AS first, max(started_at) AS last,
             max(coalesce(finished_at, started_at)) AS until, count(*) AS n, count(*) FILTER (WHERE status = 'fenced') AS fenced
        FROM ` + runs + `
       WHERE $3 = 'job' AND token IS NOT NULL AND ($2 = '' OR job = $2)
       GROUP BY job, shard, token)
SELECT coalesce(t.name, r.job), coalesce(t.shard, r.shard), coalesce(t.token, r.token), coalesce(t.holder, r.holder),
       coalesce(t.started_at, r.first), t.ended_at, coalesce(t.end_cause, ''),
       r.first, r.last, r.until, coalesce(r.n, 0), coalesce(r.fenced, 0), now()
  FROM t FULL JOIN r ON r.job = t.name AND r.shard = t.shard AND r.token = t.token
 ORDER BY coalesce(t.started_at, r.first) DESC, 1, 2
 LIMIT $1`,

		// Records the start of a term (kind $1, name $2, shard $3, token
		// $4, holder $5) unless a later one has started (a late start of a
		// zombie's), closes the earlier terms of the same lease that their
		// leaders left open (as expired), and returns the previous term:
		// its holder, token and why it ended.
		termStart: `WITH closed AS (
    UPDATE ` + t.terms + ` SET ended_at = now(), end_cause = 'expired'
     WHERE kind = $1 AND name = $2 AND shard = $3 AND token < $4 AND ended_at IS NULL
    RETURNING token, end_cause),
ins AS (INSERT INTO ` + t.terms + ` (kind, name, shard, token, holder, started_at)
    SELECT $1::text, $2::text, $3::int, $4::bigint, $5::text, now()
     WHERE NOT EXISTS (SELECT 1 FROM ` + t.terms + ` n WHERE n.kind = $1 AND n.name = $2 AND n.shard = $3 AND n.token > $4)
    ON CONFLICT DO NOTHING)
SELECT p.holder, p.token, coalesce(c.end_cause, p.end_cause, '')
  FROM ` + t.terms + ` p LEFT JOIN closed c ON c.token = p.token
 WHERE p.kind = $1 AND p.name = $2 AND p.shard = $3 AND p.token < $4
 ORDER BY p.token DESC LIMIT 1`,

		// Closes a term (kind $1, name $2, shard $3, token $4) with why
		// it ended ($5), unless the next leader already has.
		termEnd: `UPDATE ` + t.terms + ` SET ended_at = now(), end_cause = $5
 WHERE kind = $1 AND name = $2 AND shard = $3 AND token = $4 AND ended_at IS NULL`,
	}
}

// newControlSQL: the operators' steering (pause, resume, run now) and
// reading of the ledger.
func newControlSQL(schema string) controlSQL {
	t := tablesOf(schema)
	runs, jobs, leases, wake := t.runs, t.jobs, t.leases, t.wake
	return controlSQL{
		// The live instances that run member $1 (a group's member name).
		liveMembers: `SELECT coalesce(array_agg(id ORDER BY id), '{}') FROM ` + t.inst + `
 WHERE expires_at > now() AND stopped_at IS NULL AND $1 = ANY(jobs)`,
		// Sets group $1's count to $2 at once (by $3): no replica runs it.
		setCount: `UPDATE ` + t.groups + ` SET partitions = $2, registered_at = now(), registered_by = $3 WHERE group_name = $1`,

		// Finished attempts that started before $1, except those of the
		// latest scheduled slot of each job and shard (a new leader
		// resumes from it).
		// Leadership terms that ended before $1 go with them.
		prune: fmt.Sprintf(`WITH terms AS (DELETE FROM %[2]s WHERE ended_at < $1)
DELETE FROM %[1]s r
 WHERE r.started_at < $1 AND r.status NOT IN ('running', 'pending')
   AND (r.kind = 'manual'
        OR r.slot < (SELECT max(l.slot) FROM %[1]s l WHERE l.job = r.job AND l.shard = r.shard AND l.kind = 'scheduled'))`, runs, t.terms),

		// Recent attempts, newest first, optionally of one job and one
		// status.
		runs: fmt.Sprintf(`SELECT job, shard, kind, slot, attempt, coalesce(token, 0), status, holder, coalesce(requested_by, ''),
       started_at, finished_at, coalesce(error, '')
  FROM %[1]s
 WHERE ($1 = '' OR job = $1) AND ($2 = '' OR status = $2) AND ($4 = '' OR kind = $4)
 ORDER BY started_at DESC, job, shard, kind, slot DESC, attempt DESC
 LIMIT $3 OFFSET $5`, runs),

		// Pause (by $2) and resume job $1; no row for an unknown job.
		pause: `UPDATE ` + jobs + ` SET paused_by = CASE WHEN paused_at IS NULL THEN $2 ELSE paused_by END,
       paused_at = coalesce(paused_at, now())
 WHERE job = $1 RETURNING paused_at`,
		resume: `UPDATE ` + jobs + ` SET paused_at = NULL, paused_by = NULL WHERE job = $1 RETURNING job`,

		jobShards: `SELECT shards FROM ` + jobs + ` WHERE job = $1`,
		// Asks for a manual run of job $1's shard $2 (by $3), announced to
		// the shard's leader through the wake name $4 at commit.
		request: `WITH req AS (
    INSERT INTO ` + runs + ` (job, shard, kind, slot, attempt, status, holder, requested_by, started_at)
    VALUES ($1, $2, 'manual', clock_timestamp(), 1, 'pending', $3, $3, now())
    RETURNING slot)
SELECT slot, ` + wake + `($4) FROM req`,

		// The latest attempt of a slot, with the job's max attempts.
		waitRun: `SELECT r.job, r.shard, r.kind, r.slot, r.attempt, coalesce(r.token, 0), r.status, r.holder,
       coalesce(r.requested_by, ''), r.started_at, r.finished_at, coalesce(r.error, ''), coalesce(j.max_attempts, 1)
  FROM ` + runs + ` r LEFT JOIN ` + jobs + ` j ON j.job = r.job
 WHERE r.job = $1 AND r.shard = $2 AND r.kind = $3 AND r.slot = $4
 ORDER BY r.attempt DESC LIMIT 1`,

		// Every registered job (or job $1) and shard: the pause, the
		// lease (named $2 || job [|| '/' || shard]), the latest attempt of
		// the latest scheduled slot, the pending manual runs, and the
		// database's now.
		jobs: `WITH s AS (
    SELECT j.*, g.shard FROM ` + jobs + ` j, generate_series(0, greatest(j.shards, 1) - 1) AS g(shard)
     WHERE $1 = '' OR j.job = $1)
SELECT s.job, s.shard, s.shards, s.schedule, s.paused_at, coalesce(s.paused_by, ''),
       coalesce(l.holder, ''), coalesce(l.token, 0), l.acquired_at, coalesce(l.holder IS NOT NULL AND l.expires_at > now(), false),
       last.kind, last.slot, last.attempt, last.token, last.status, last.holder, last.requested_by,
       last.started_at, last.finished_at, last.error,
       (SELECT count(*) FROM ` + runs + ` p WHERE p.job = s.job AND p.shard = s.shard AND p.kind = 'manual' AND p.status = 'pending'),
       now()
  FROM s
  LEFT JOIN ` + leases + ` l
         ON l.name = $2 || s.job || CASE WHEN s.shards = 0 THEN '' ELSE '/' || s.shard END
  LEFT JOIN LATERAL (
         SELECT kind, slot, attempt, coalesce(token, 0) AS token, status, holder, coalesce(requested_by, '') AS requested_by,
                started_at, finished_at, coalesce(error, '') AS error
           FROM ` + runs + ` r WHERE r.job = s.job AND r.shard = s.shard AND r.kind = 'scheduled'
          ORDER BY slot DESC, attempt DESC LIMIT 1) AS last ON true
 ORDER BY s.job, s.shard`,
	}
}
