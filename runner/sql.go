package runner

import (
	"fmt"

	"github.com/pgfence/pgfence/internal/ident"
)

type queries struct {
	claim, succeed, succeedFenced, fail, markFenced, lastSlot, heartbeat, leave string
}

func newQueries(schema string) queries {
	runs := ident.Table(schema, "pgfence_runs")
	inst := ident.Table(schema, "pgfence_instances")
	return queries{
		// Carries its own fence (fence.Guard.Fold at $7, $8): one
		// autocommitted statement, refused if the lease moved on. A slot is
		// (re)claimed if it is new, was fenced, is still "running" under an
		// older token (its runner died or was paused), or failed with
		// attempts left. It returns no row for a slot that is finished.
		claim: fmt.Sprintf(`INSERT INTO %[1]s AS r (job, shard, slot, attempt, token, status, holder, started_at)
SELECT $1, $2, $3, 1, $4, 'running', $5, now() FROM (SELECT %%s) AS fence
ON CONFLICT (job, shard, slot) DO UPDATE
   SET attempt = r.attempt + 1, token = EXCLUDED.token, status = 'running', holder = EXCLUDED.holder,
       started_at = now(), finished_at = NULL, error = NULL
 WHERE r.status = 'fenced'
    OR (r.status = 'running' AND r.token < EXCLUDED.token)
    OR (r.status = 'failed' AND r.attempt < $6)
RETURNING r.attempt`, runs),

		// Fenced (in CommitTx's guarded transaction, or by a folded check
		// at $5, $6 on its own) and conditioned on the token: a zombie's
		// late outcome changes nothing.
		succeed: fmt.Sprintf(`UPDATE %[1]s SET status = 'succeeded', finished_at = now()
 WHERE job = $1 AND shard = $2 AND slot = $3 AND token = $4 AND status = 'running'`, runs),
		succeedFenced: fmt.Sprintf(`UPDATE %[1]s SET status = 'succeeded', finished_at = now() FROM (SELECT %%s) AS fence
 WHERE job = $1 AND shard = $2 AND slot = $3 AND token = $4 AND status = 'running'`, runs),
		fail: fmt.Sprintf(`UPDATE %[1]s SET status = 'failed', finished_at = now(), error = $7 FROM (SELECT %%s) AS fence
 WHERE job = $1 AND shard = $2 AND slot = $3 AND token = $4 AND status = 'running'`, runs),

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
		leave: fmt.Sprintf(`UPDATE %[1]s SET expires_at = now() WHERE id = $1`, inst),
	}
}
