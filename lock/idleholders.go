package lock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ownconn"
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
// transaction, about 4-5% of a one-row transaction on PostgreSQL 15
// (BENCHMARKS.md); it remains for takers that wait (WaitForIdleHolders).

// idleHolderAfter is how long a statement waits on a lease row before it
// first looks for idle holders, how often it looks again while it waits,
// and how long a transaction must have sat idle to be ended.
const idleHolderAfter = 250 * time.Millisecond

// idleHolderTimeout bounds one look (and the sessions it ends).
const idleHolderTimeout = 5 * time.Second

// lookHook, when set (by tests), hears each look for idle holders of lease
// name: when it starts (done false) and when it ends (done true, with its
// error).
var lookHook atomic.Pointer[func(name string, done bool, err error)]

// hookLook calls lookHook if it is set.
func hookLook(name string, done bool, err error) {
	if h := lookHook.Load(); h != nil {
		(*h)(name, done, err)
	}
}

// idleLook is one look: it ends the idle holders it finds and returns them.
type idleLook func(ctx context.Context) ([]Backend, error)

// watchIdleHolders runs look from idleHolderAfter on and every
// idleHolderAfter after that, until stop is called; report hears each look
// that ended a session or failed. stop cancels the looking and waits for
// the look in progress (calling it again does nothing): the watcher's one
// owner is the waiting statement's caller.
func watchIdleHolders(ctx context.Context, name string, look idleLook, report func(ended []Backend, err error)) (stop func()) {
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
			hookLook(name, false, nil)
			lctx, lcancel := context.WithTimeout(ctx, idleHolderTimeout)
			ended, err := look(lctx)
			lcancel()
			hookLook(name, true, err)
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

// endIdleHolders ends the sessions idle in a transaction for at least
// idleHolderAfter that block the statement of backend waiter (nil: not
// known, as behind PgBouncer) or any statement waiting on the row of lease
// name, if that lease has expired
// or is free, and returns them. A session it may not end (another role's,
// without pg_signal_backend) or whose state it may not see is an error that
// names it; the others are ended all the same, also once ctx has ended
// (each was still idle in the transaction that held the row).
func endIdleHolders(ctx context.Context, db fence.DB, q *queries, name string, waiter *int64) ([]Backend, error) {
	type found struct {
		b     Backend
		xid   *string
		since *time.Time
	}
	rows, err := db.Query(ctx, q.idleHolders, name, idleHolderAfter.Microseconds(), waiter)
	if err != nil {
		return nil, err
	}
	all, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (found, error) {
		var (
			f  found
			at *time.Time
		)
		err := r.Scan(&f.b.PID, &f.b.Application, &f.b.User, &f.b.State, &at, &f.b.Query, &f.xid, &f.since)
		if at != nil {
			f.b.XactStart = *at
		}
		return f, err
	})
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
	for _, f := range all {
		if f.b.State == "" || f.xid == nil || f.since == nil {
			errs = append(errs, fmt.Errorf("session %d (user %q) blocks it, and this role may not see its state", f.b.PID, f.b.User))
			continue
		}
		var gone bool
		switch err := db.QueryRow(kctx, q.endBackend, f.b.PID, *f.xid, *f.since).Scan(&gone); {
		case errors.Is(err, pgx.ErrNoRows):
			// It has moved on since the look: not ours to end.
		case err != nil:
			errs = append(errs, fmt.Errorf("ending session %d (user %q): %w", f.b.PID, f.b.User, err))
		case gone:
			ended = append(ended, f.b)
		}
	}
	return ended, errors.Join(errs...)
}

// looker runs a client's looks for idle holders, one at a time, on a
// connection of its own: the statements waiting on lease rows may hold
// every pooled connection. It is opened on the first look and closed with
// the client.
type looker struct {
	turn   chan struct{} // holds one token: the right to use conn
	conn   *ownconn.Conn
	closed bool // under turn
}

// newLooker returns a looker whose connection is opened from pool.
func newLooker(pool *pgxpool.Pool) *looker {
	l := &looker{turn: make(chan struct{}, 1), conn: ownconn.New(pool)}
	l.turn <- struct{}{}
	return l
}

// look is one look for idle holders of lease name that block backend
// waiter (see endIdleHolders). It waits its turn only as long as ctx.
func (l *looker) look(ctx context.Context, q *queries, name string, waiter *int64) ([]Backend, error) {
	select {
	case <-l.turn:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { l.turn <- struct{}{} }()
	if l.closed {
		return nil, ErrClosed
	}
	return endIdleHolders(ctx, l.conn, q, name, waiter)
}

// close closes the connection, once the look in progress is done; looks
// after it fail with ErrClosed.
func (l *looker) close() {
	<-l.turn
	defer func() { l.turn <- struct{}{} }()
	l.closed = true
	l.conn.Close()
}

// watchIdleHolders watches, for the client, the acquisition of lease name
// on backend waiter: see Config.WaitForIdleHolders.
func (c *Client) watchIdleHolders(ctx context.Context, name string, waiter *int64) (stop func()) {
	look := func(ctx context.Context) ([]Backend, error) { return c.idle.look(ctx, c.q, name, waiter) }
	warned := false
	return watchIdleHolders(ctx, name, look, func(ended []Backend, err error) {
		for _, b := range ended {
			c.stats.idleEnded.Add(1)
			c.log.Warn("pgfence: ended a session idle in a transaction on an expired lease's row, which blocked its acquisition",
				"lease", name, "pid", b.PID, "application", b.Application, "user", b.User,
				"xact_start", b.XactStart, "query", b.Query)
		}
		if err != nil && !warned && !errors.Is(err, ErrClosed) {
			warned = true
			c.log.Warn("pgfence: an acquisition waits on an expired lease's row, and looking for sessions idle "+
				"in a transaction there, to end them, failed (see err; if it is a matter of rights: a role may end its own "+
				"role's sessions, and others' with pg_signal_backend, seeing their state with pg_read_all_stats; or bound "+
				"guarded transactions at the server: Config.GuardIdleTimeout)",
				"lease", name, "err", err)
		}
	})
}

// backendPID returns the PID of conn's backend if it is the one the server
// announced when conn connected, or nil: behind PgBouncer the announced
// one is the pooler's key, and the backend may change with each
// transaction.
func backendPID(ctx context.Context, conn *pgx.Conn) *int64 {
	var pid int64
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil || pid != int64(conn.PgConn().PID()) {
		return nil
	}
	return &pid
}
