package lock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
)

// A holder frozen inside a guarded transaction (a GC pause, SIGSTOP, a
// stalled VM) or cut off from the server without a FIN keeps the lease row's
// KEY SHARE lock for as long as its session lives, and the takeover's FOR
// UPDATE waits for it. Once the lease has expired nothing the holder could
// still do there may commit after a greater token is issued, and ending the
// session aborts its transaction: that is all the takeover needs. So a
// statement that waits on the row of an expired or free lease (an
// acquisition, ForceRelease) looks for such sessions and ends them.
//
// Doing it here, on the rare takeover that waits, costs nothing per guarded
// transaction. The other way, a server-side idle bound set in every guarded
// transaction (fence.Guard.IdleTimeout), costs a changed setting per
// transaction, about 2% of a one-row transaction on PostgreSQL 15
// (BENCHMARKS.md); it remains for takers that wait (WaitForIdleHolders).

// idleHolderAfter is how long a statement waits on a lease row before it
// first looks for idle holders, how often it looks again while it waits,
// and how long a transaction must have sat idle to be ended.
const idleHolderAfter = 250 * time.Millisecond

// idleHolderTimeout bounds one look (and the sessions it ends).
const idleHolderTimeout = 5 * time.Second

// watchIdleHolders looks for and ends the sessions idle in a transaction
// that block a statement waiting on the row of lease name (endIdleHolders),
// from idleHolderAfter on and every idleHolderAfter after that, until stop
// is called; report hears each look that ended a session or failed. stop
// cancels the looking and waits for the look in progress (calling it again
// does nothing): the watcher's one owner is the statement's caller.
func watchIdleHolders(ctx context.Context, db fence.DB, q *queries, name string,
	report func(ended []Backend, err error)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	timer := time.AfterFunc(idleHolderAfter, func() {
		defer close(done)
		next := time.NewTimer(0)
		defer next.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-next.C:
			}
			lctx, lcancel := context.WithTimeout(ctx, idleHolderTimeout)
			ended, err := endIdleHolders(lctx, db, q, name)
			lcancel()
			if ctx.Err() != nil {
				// The statement is done (often because of what this
				// look ended): a failure no longer matters, what was
				// ended does.
				err = nil
			}
			if len(ended) > 0 || err != nil {
				report(ended, err)
			}
			next.Reset(idleHolderAfter)
		}
	})
	return sync.OnceFunc(func() {
		cancel()
		if !timer.Stop() {
			<-done
		}
	})
}

// endIdleHolders ends, once, the sessions idle in a transaction for at
// least idleHolderAfter that block a statement waiting on the row of lease
// name, if that lease has expired or is free, and returns them. A session
// it may not end (another role's, without pg_signal_backend) or whose state
// it may not see is an error that names it; the others are ended all the
// same.
func endIdleHolders(ctx context.Context, db fence.DB, q *queries, name string) ([]Backend, error) {
	rows, err := db.Query(ctx, q.idleHolders, name, idleHolderAfter.Microseconds())
	if err != nil {
		return nil, err
	}
	found, err := pgx.CollectRows(rows, scanBackend)
	if err != nil {
		return nil, err
	}
	// A session ended frees the row, and the waiting statement then ends
	// the look's context, maybe before the answer is read: the ending is
	// seen through on a context of its own, so that it is counted.
	kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), idleHolderTimeout)
	defer cancel()
	var (
		ended []Backend
		errs  []error
	)
	for _, b := range found {
		if b.State == "" {
			errs = append(errs, fmt.Errorf("session %d (user %q) blocks it, and this role may not see its state", b.PID, b.User))
			continue
		}
		var gone bool
		if err := db.QueryRow(kctx, q.endSession, b.PID).Scan(&gone); err != nil {
			errs = append(errs, fmt.Errorf("ending session %d (user %q): %w", b.PID, b.User, err))
			continue
		}
		if gone {
			ended = append(ended, b)
		}
	}
	return ended, errors.Join(errs...)
}

// reportIdleHolders is the client's report for watchIdleHolders: each
// ended session is logged and counted; the first failure of a watch is
// logged with what would let the client end such sessions.
func (c *Client) reportIdleHolders(name string) func([]Backend, error) {
	warned := false
	return func(ended []Backend, err error) {
		for _, b := range ended {
			c.stats.idleEnded.Add(1)
			c.cfg.Logger.Warn("pgfence: ended a session idle in a transaction on an expired lease's row, which blocked its acquisition",
				"lease", name, "pid", b.PID, "application", b.Application, "user", b.User, "state", b.State,
				"xact_start", b.XactStart, "query", b.Query)
		}
		if err != nil && !warned {
			warned = true
			c.cfg.Logger.Warn("pgfence: an acquisition waits for a session idle in a transaction on an expired lease's row, "+
				"and could not end it; grant the client's role pg_signal_backend (and pg_read_all_stats to see other roles' "+
				"sessions), or bound guarded transactions at the server (Config.GuardIdleTimeout)", "lease", name, "err", err)
		}
	}
}
