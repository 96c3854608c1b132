package fence

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
)

// Running a fenced transaction to a known end: begin, fence, fn, COMMIT, and
// when COMMIT's answer is lost, the server's word on what became of it. The
// one loop behind Guard.RunTx and Resource.RunTx (and so Lease.RunTx and the
// runner's Run.RunTx and Run.CommitTx).

// runTx runs fn in transactions fenced by f until one commits, fails for
// good, or MaxAttempts attempts provably did not commit.
func runTx(ctx context.Context, db DB, f *txFence, fn func(tx pgx.Tx) error) error {
	if db == nil {
		return errors.New("fence: nil database handle")
	}
	if fn == nil {
		return errors.New("fence: nil function")
	}
	var (
		err        error
		committing bool
	)
	for attempt := 1; attempt <= MaxAttempts; attempt++ {
		committing, err = runOnce(ctx, db, f, fn)
		if !retryable(err, committing) || ctx.Err() != nil {
			break
		}
	}
	if err != nil && !committing && retry.ConnectionLost(err) && !errors.Is(err, ErrNotCommitted) {
		// Lost before COMMIT was sent: say so, for Retryable, which
		// cannot tell that from the error alone.
		err = fmt.Errorf("%w: %w (the connection was lost before COMMIT was sent)", ErrNotCommitted, err)
	}
	f.metrics.outcome(ctx, err, true)
	return err
}

// runOnce runs one attempt; committing reports that COMMIT may have been
// sent (its error, if any, is final: resolved by commit).
func runOnce(ctx context.Context, db DB, f *txFence, fn func(tx pgx.Tx) error) (committing bool, err error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() {
		if err != nil && !committing {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	gtx := &guardedTx{Tx: tx, fence: f, bound: ctx}
	if err := fn(gtx); err != nil {
		return false, err
	}
	if err := gtx.ensure(ctx); err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil {
		// Not sent: rolled back by the deferred call, certainly.
		return false, context.Cause(ctx)
	}
	return true, commit(ctx, db, gtx)
}

// commit sends COMMIT and returns nil only if the transaction committed,
// an error matching ErrNotCommitted, or the server's own refusal, only if it
// did not, and ErrOutcomeUnknown when nobody can tell.
func commit(ctx context.Context, db DB, t *guardedTx) error {
	err := t.Tx.Commit(ctx)
	if err == nil || refused(err) {
		return err
	}
	return resolve(ctx, db, t, err)
}

// refused reports a failed COMMIT that the server itself answered with "not
// committed": an ERROR (a serialization failure, a deferred constraint) or a
// ROLLBACK (the transaction had failed). Nothing else proves that it did
// not commit, once COMMIT may have been written:
//
//   - a FATAL or a PANIC (the session terminated, the server shutting
//     down) can arrive after the commit record was written, before the
//     reply was sent;
//   - a broken or closed connection says nothing of what the server did
//     with a COMMIT it may have read;
//   - pgconn.SafeToRetry in particular is no such proof. When the connection
//     is reset right after COMMIT reached the server, pgx v5 reports the
//     closed connection as an error of a request that was never sent
//     (pgconn.ErrConnClosed, SafeToRetry true), and the transaction is
//     committed: observed every time on PostgreSQL 15 with pgx v5.12 (the
//     fault is the proxy's ResetAfterReply; TestCommitUnderWireFaults).
//
// All of those are resolved by asking the server (resolve).
func refused(err error) bool {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return !fatal(pg)
	}
	return errors.Is(err, pgx.ErrTxCommitRollback)
}

// resolvePoll is how often resolve asks again while the server still has
// the transaction in progress (its COMMIT not yet done).
const resolvePoll = 20 * time.Millisecond

// resolveGrace is how long resolve lets a transaction stay in progress
// before it ends the transaction's backend itself. A COMMIT the server is
// executing is done well within it; a backend still in the transaction
// after it is one whose client is gone without the server knowing (a
// half-open connection: the peer vanished without a FIN, a COMMIT held in
// the network), which would otherwise keep the transaction, and the lease
// row's lock, until the idle bound or TCP keepalives end it.
const resolveGrace = time.Second

// resolve finds out from the server whether the transaction whose COMMIT
// failed without the server's answer (cause) committed: pg_xact_status of
// its id, read in the first round trip, on another connection of db (a
// pool; a single connection broke with the COMMIT, and cannot be asked). It
// returns nil if the transaction committed, ErrNotCommitted if it aborted,
// and ErrOutcomeUnknown when the server cannot be asked within
// wait.CleanupTimeout, or is no longer the one the transaction ran on (its
// timeline changed: a promoted standby's transaction ids are not the old
// primary's).
//
// A transaction still in progress after resolveGrace has its backend
// terminated (only if it is still in that transaction): the server then
// either finishes the commit it has begun, or aborts; either answer is
// the truth, and the caller gets it instead of "unknown".
func resolve(ctx context.Context, db DB, t *guardedTx, cause error) error {
	unknown := func(why string) error { return fmt.Errorf("%w: %w (%s)", ErrOutcomeUnknown, cause, why) }
	if t.xid == "" {
		return unknown("the transaction's id was not read")
	}
	if c, isConn := db.(*pgx.Conn); isConn && c.IsClosed() {
		return unknown("its connection is closed and there is no other to ask the server on")
	}
	if _, isTx := db.(pgx.Tx); isTx {
		return unknown("a savepoint of a transaction whose connection broke: the outcome is that transaction's")
	}
	ctx, cancel := wait.Detached(ctx)
	defer cancel()
	db, done := asker(ctx, db)
	defer done()
	again := retry.Backoff{Base: resolvePoll, Max: time.Second}
	var inProgress time.Time // when the transaction was first seen in progress
	terminated := false
	for n := 0; ; n++ {
		var (
			status   *string
			timeline int64
		)
		err := db.QueryRow(ctx, xactStatusSQL(t.fence.schema), t.xid).Scan(&status, &timeline)
		switch {
		case err != nil && retry.Transient(err) && wait.Sleep(ctx, again.Wait(n)):
			continue // the server restarting, a failover: ask again
		case err != nil:
			return unknown("asking the server failed: " + err.Error())
		case timeline != t.timeline:
			return unknown(fmt.Sprintf("the server changed timeline (%d, then %d) before it could be asked", t.timeline, timeline))
		case status == nil:
			return unknown("the server no longer knows the transaction")
		case *status == "committed":
			return nil
		case *status == "aborted":
			return fmt.Errorf("%w: %w (the server reports transaction %s aborted)", ErrNotCommitted, cause, t.xid)
		}
		// "in progress": the COMMIT is not done yet, or never arrived.
		if inProgress.IsZero() {
			inProgress = time.Now()
		}
		if !terminated && time.Since(inProgress) >= resolveGrace {
			// Failing to end it (no privilege over that backend) leaves
			// the waiting to the server's own bounds.
			_, _ = db.Exec(ctx, terminateXactSQL, t.xid)
			terminated = true
		}
		if !wait.Sleep(ctx, resolvePoll) {
			return unknown("the server still had the transaction in progress")
		}
	}
}

// asker returns the handle resolve asks the server on, and what to call
// when done. For a pool it is a connection of its own, dialled with the
// pool's settings: the pool's connections may be held by the very fault
// that lost the reply, and its slots taken by connections pgx is still
// closing (it waits up to 15 s for a server that does not answer), so that
// a question asked through the pool would wait for a free slot past the
// cleanup deadline. If that dial fails (a pool that authenticates in its
// BeforeConnect hook), the pool it is.
func asker(ctx context.Context, db DB) (DB, func()) {
	pool, ok := db.(*pgxpool.Pool)
	if !ok {
		return db, func() {}
	}
	dctx, cancel := context.WithTimeout(ctx, wait.CleanupTimeout/2) // leave the pool time to answer
	defer cancel()
	conn, err := pgx.ConnectConfig(dctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		return db, func() {}
	}
	return conn, func() {
		cctx, cancel := context.WithTimeout(context.Background(), cancelTimeout)
		defer cancel()
		_ = conn.Close(cctx)
	}
}

// retryable reports a failure that provably left nothing committed and can
// pass: a definite abort (40001, 40P01, before or at COMMIT), a lost
// connection before COMMIT was sent, or a COMMIT the server reports
// aborted (ErrNotCommitted). A lost connection during COMMIT is never one
// by itself: commit has resolved it.
func retryable(err error, committing bool) bool {
	if errors.Is(err, ErrOutcomeUnknown) {
		return false
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) && (pg.Code == "40001" || pg.Code == "40P01") {
		return true
	}
	return !committing && retry.ConnectionLost(err) || errors.Is(err, ErrNotCommitted)
}
