package fence

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/internal/outcome"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/txbound"
)

// Running a fenced transaction to a known end: begin, fence, fn, COMMIT, and
// when COMMIT's answer is lost, the server's word on what became of it. The
// one loop behind Guard.RunTx and Resource.RunTx (and so Lease.RunTx and the
// runner's Run.RunTx and Run.CommitTx).

// runTx runs fn in transactions fenced by f until one commits, fails for
// good, or MaxAttempts attempts provably did not commit.
func runTx(ctx context.Context, db DB, f *txFence, fn func(tx pgx.Tx) error) error {
	if err := pgexec.NotNil(db, "fence: RunTx"); err != nil {
		return err
	}
	if fn == nil {
		return errors.New("fence: nil function")
	}
	// A lease's end bounds the transaction (txbound), not the question
	// about a lost COMMIT answer, which has the caller's budget.
	bound := ctx
	if b, ok := txbound.From(ctx); ok {
		var cancel context.CancelCauseFunc
		bound, cancel = context.WithCancelCause(ctx)
		defer cancel(nil)
		stop := context.AfterFunc(b, func() { cancel(context.Cause(b)) })
		defer stop()
	}
	var a attempt
	for n := 1; n <= MaxAttempts; n++ {
		a = runOnce(bound, ctx, db, f, fn)
		if !a.retryable() || bound.Err() != nil {
			break
		}
	}
	err := a.err
	if a.lost && !errors.Is(err, ErrNotCommitted) {
		// Lost before COMMIT was sent: say so, for Retryable, which
		// cannot tell that from the error alone.
		err = fmt.Errorf("%w: %w (the connection was lost before COMMIT was sent)", ErrNotCommitted, err)
	}
	f.metrics.outcome(ctx, err, true)
	return err
}

// attempt is how one run of a fenced transaction ended.
type attempt struct {
	err error
	// committing: COMMIT may have been sent; err, if any, is final
	// (commit resolved it).
	committing bool
	// lost: the transaction's connection broke (or could not be had)
	// before COMMIT was sent, so nothing of it can commit.
	lost bool
}

// retryable reports an attempt that provably left nothing committed, for
// a reason that can pass: a definite abort (40001, 40P01, before or at
// COMMIT), the transaction's connection lost before COMMIT was sent, or a
// COMMIT the server reports aborted (ErrNotCommitted). An error of fn's own
// while the connection is fine (a call to another service failing) is
// not: it is fn's to return.
func (a attempt) retryable() bool {
	if a.err == nil || errors.Is(a.err, ErrOutcomeUnknown) {
		return false
	}
	var pg *pgconn.PgError
	if errors.As(a.err, &pg) && (pg.Code == "40001" || pg.Code == "40P01") {
		return true
	}
	return a.lost || errors.Is(a.err, ErrNotCommitted)
}

// runOnce runs one attempt under ctx, and asks about a lost COMMIT answer
// within budget (ctx, or the caller's context that ctx narrows).
func runOnce(ctx, budget context.Context, db DB, f *txFence, fn func(tx pgx.Tx) error) attempt {
	tx, err := db.Begin(ctx)
	if err != nil {
		// Nothing was sent for this transaction.
		return attempt{err: err, lost: retry.ConnectionLost(err)}
	}
	failed := func(err error) attempt {
		conn := tx.Conn()
		lost := conn != nil && conn.IsClosed()
		pgexec.Rollback(ctx, tx)
		return attempt{err: err, lost: lost}
	}
	gtx := &guardedTx{Tx: tx, fence: f, bound: ctx}
	if err := fn(gtx); err != nil {
		return failed(err)
	}
	if err := gtx.ensure(ctx); err != nil {
		return failed(err)
	}
	if err := ctx.Err(); err != nil {
		return failed(context.Cause(ctx)) // not sent: rolled back, certainly
	}
	return attempt{err: commit(ctx, budget, db, gtx), committing: true}
}

// commit sends COMMIT under ctx and returns nil only if the transaction
// committed, an error matching ErrNotCommitted, or the server's own
// refusal, only if it did not, and an *UnknownOutcomeError when nobody can
// tell within budget. A COMMIT that fails without the server's ERROR or
// ROLLBACK (outcome.Refused says why nothing else, pgx's SafeToRetry
// included, proves an abort) is resolved by asking the server on another
// connection of db (outcome.Resolve).
func commit(ctx, budget context.Context, db DB, t *guardedTx) error {
	err := t.Tx.Commit(ctx)
	if err == nil || outcome.Refused(err) {
		return err
	}
	return UnknownOutcome(outcome.Outcome(budget, db, t.fence.schema, t.id, err))
}
