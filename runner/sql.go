package runner

import (
	"fmt"

	"github.com/pgfence/pgfence/internal/ident"
)

// queries holds the runner's SQL for one schema. The fenced ledger
// statements are functions of the fence expression (fence.Guard.Fold), built
// once per leadership term; each numbers its own parameters first, and the
// fold's two come after them.
type queries struct {
	claim, succeedFenced, fail func(fence string) string

	succeed, markFenced, lastSlot, heartbeat, announce, leave, prune, runs string
}

func newQueries(schema string) queries {
	runs := ident.Table(schema, "pgfence_runs")
	inst := ident.Table(schema, "pgfence_instances")
	wake := ident.Table(schema, "pgfence_wake_waiters")
	return queries{
		// Carries its own fence (after its six parameters): one
		// autocommitted statement, refused if the lease moved on. A slot is
		// (re)claimed if it is new, was fenced, is still "running" under an
		// older token (its runner died or was paused), or failed with
		// attempts left. It returns no row for a slot that is finished.
		claim: func(fence string) string {
			return `INSERT INTO ` + runs + ` AS r (job, shard, slot, attempt, token, status, holder, started_at)
SELECT $1, $2, $3, 1, $4, 'running', $5, now() FROM (SELECT ` + fence + `) AS fence
ON CONFLICT (job, shard, slot) DO UPDATE
   SET attempt = r.attempt + 1, token = EXCLUDED.token, status = 'running', holder = EXCLUDED.holder,
       started_at = now(), finished_at = NULL, error = NULL
 WHERE r.status = 'fenced'
    OR (r.status = 'running' AND r.token < EXCLUDED.token)
    OR (r.status = 'failed' AND r.attempt < $6)
RETURNING r.attempt`
		},

		// Fenced (in CommitTx's guarded transaction, or by a folded check
		// of its own) and conditioned on the token: a zombie's late outcome
		// changes nothing.
		succeed: fmt.Sprintf(`UPDATE %[1]s SET status = 'succeeded', finished_at = now()
 WHERE job = $1 AND shard = $2 AND slot = $3 AND token = $4 AND status = 'running'`, runs),
		succeedFenced: func(fence string) string {
			return `UPDATE ` + runs + ` SET status = 'succeeded', finished_at = now() FROM (SELECT ` + fence + `) AS fence
 WHERE job = $1 AND shard = $2 AND slot = $3 AND token = $4 AND status = 'running'`
		},
		fail: func(fence string) string {
			return `UPDATE ` + runs + ` SET status = 'failed', finished_at = now(), error = $5 FROM (SELECT ` + fence + `) AS fence
 WHERE job = $1 AND shard = $2 AND slot = $3 AND token = $4 AND status = 'running'`
		},

		// Not guarded (the lease is gone) but conditioned on the token:
		// it only marks this attempt's own row, never a newer attempt's.
		markFenced: fmt.Sprintf(`UPDATE %[1]s SET status = 'fenced', finished_at = now(), error = $5
 WHERE job = $1 AND shard = $2 AND slot = $3 AND token = $4 AND status = 'running'`, runs),

		lastSlot: fmt.Sprintf(`SELECT max(slot) FROM %[1]s WHERE job = $1 AND shard = $2`, runs),

		// Renews this instance's row (with the sharded jobs it runs),
		// deletes rows of instances dead for longer than $4, and returns
		// the live instances with their jobs.
		heartbeat: fmt.Sprintf(`WITH me AS (
    INSERT INTO %[1]s (id, started_at, heartbeat_at, expires_at, jobs)
    VALUES ($1, now(), now(), now() + $2 * interval '1 microsecond', $3)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), expires_at = EXCLUDED.expires_at, jobs = EXCLUDED.jobs
    RETURNING id, jobs),
gone AS (DELETE FROM %[1]s WHERE expires_at < now() - $4 * interval '1 microsecond' AND id <> $1)
SELECT id, jobs FROM %[1]s WHERE expires_at > now() AND id <> $1
UNION ALL
SELECT id, jobs FROM me`, inst),
		// Announces a change of members (a join, or with leave a graceful
		// leave) to every runner of the schema, on the channel blocked
		// acquirers listen to, as a release of the pseudo-lease $1.
		announce: fmt.Sprintf(`SELECT %[1]s($1)`, wake),
		leave: fmt.Sprintf(`WITH gone AS (UPDATE %[1]s SET expires_at = now() WHERE id = $1 RETURNING id)
SELECT %[2]s($2) FROM gone`, inst, wake),

		// Finished runs that started before $1, except the latest slot of
		// each job and shard (a new leader resumes from it).
		prune: fmt.Sprintf(`DELETE FROM %[1]s r
 WHERE r.started_at < $1 AND r.status <> 'running'
   AND r.slot < (SELECT max(l.slot) FROM %[1]s l WHERE l.job = r.job AND l.shard = r.shard)`, runs),

		// Recent runs, newest first, optionally of one job and one status.
		runs: fmt.Sprintf(`SELECT job, shard, slot, attempt, token, status, holder, started_at, finished_at, coalesce(error, '')
  FROM %[1]s
 WHERE ($1 = '' OR job = $1) AND ($2 = '' OR status = $2)
 ORDER BY started_at DESC, job, shard
 LIMIT $3`, runs),
	}
}
