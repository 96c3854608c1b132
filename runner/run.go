package runner

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/lock"
)

// Run is one attempt of a job for one slot (and shard), handed to Job.Run.
type Run struct {
	// Job is the job's name.
	Job string
	// Shard is the shard this run is for (0 for an unsharded job).
	Shard int
	// Shards is the job's shard count (0 for an unsharded job).
	Shards int
	// Slot is the schedule slot this run is for, or, for a manual run,
	// when it was asked for.
	Slot time.Time
	// Manual is true for a run asked for with RunNow (pgfence jobs run).
	Manual bool
	// Attempt counts attempts at this slot, from 1.
	Attempt int
	// Token is the fencing token of the lease the run holds. Send it to
	// any resource outside PostgreSQL that the run writes to.
	Token fence.Token

	w         *worker
	lease     *lock.Lease
	committed bool
}

// Lease returns the lease the run holds.
func (r *Run) Lease() *lock.Lease { return r.lease }

// Guard returns the fence guard for the run's token.
func (r *Run) Guard() fence.Guard { return r.lease.Guard() }

// RunTx runs fn in a transaction fenced by the run's token: if another
// replica has taken the job over, it is refused (fence.ErrStaleToken) and
// nothing of it commits.
func (r *Run) RunTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	if err := ctxcheck.NotNil(ctx, "runner: Run.RunTx"); err != nil {
		return err
	}
	return r.lease.RunTx(ctx, fn)
}

// CommitTx is RunTx that also records the slot's success in the same
// transaction: the run's final writes and its success commit together or not
// at all, so the job's effects and the ledger stay one to one even if the
// process dies right after. Call it at most once, as the run's last step;
// after it succeeds, the runner records nothing more for this run. A zombie
// is refused by the database (fence.ErrStaleToken, or ErrFenced if a newer
// attempt claimed the slot) or, when it already knows its lease ended, before
// anything is sent (lock.ErrLeaseLost); all of them match fence.ErrFenced.
// Like RunTx, its statements are cancelled when the lease ends, and its
// answer is the truth about the commit (fence.Guard.RunTx): when it has
// committed, the slot is succeeded, and the runner reports it so even if
// the job then returns an error, or CommitTx itself could not learn the
// outcome (fence.ErrOutcomeUnknown): the ledger decides.
func (r *Run) CommitTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	if err := ctxcheck.NotNil(ctx, "runner: Run.CommitTx"); err != nil {
		return err
	}
	err := r.lease.RunTx(ctx, func(tx pgx.Tx) error {
		if err := fn(tx); err != nil {
			return err
		}
		return r.w.r.recordSuccess(ctx, tx, r)
	})
	if err == nil {
		r.committed = true
	}
	return err
}
