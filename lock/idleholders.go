package lock

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/wait"
)

// A holder frozen inside a guarded transaction (a GC pause, SIGSTOP, a
// stalled VM) or cut off without a FIN keeps the lease row's KEY SHARE
// lock as long as its session lives, and the takeover's FOR UPDATE waits
// for it. Once the lease has expired, ending that session (which aborts
// its transaction) is all the takeover needs: so a statement waiting on the
// row of an expired or free lease (an acquisition, ForceRelease) ends such
// sessions. Only the rare takeover that waits pays, where a server-side
// idle bound (fence.Guard.IdleTimeout) costs every guarded transaction
// 4-6% (BENCHMARKS.md).

// idleHolderAfterFor is Config.IdleHolderAfter's default: a quarter of
// PollInterval keeps a frozen holder's takeover within TTL + 1.25
// PollInterval; the floor spares the server, the ceiling keeps the wait
// small beside the lease's own.
func idleHolderAfterFor(ttl, poll time.Duration) time.Duration {
	return max(10*time.Millisecond, min(poll/4, ttl/10, time.Second))
}

// forceReleaseIdleAfter is ForceRelease's: the default with the defaults.
const forceReleaseIdleAfter = 250 * time.Millisecond

// idleHolderTimeout bounds one look (and the sessions it ends).
const idleHolderTimeout = 5 * time.Second

// idleLook is one look: it ends the idle holders it finds and returns them.
// stopping ends when the statement is done, ctx when its caller gives up
// (both within idleHolderTimeout): a query on ctx finishes rather than
// having its connection closed mid-query.
type idleLook func(stopping, ctx context.Context) ([]Backend, error)

// watchIdleHolders runs look after after, and every after, until stop;
// report hears each look that ended a session or failed. stop waits for
// the look in progress; its one owner is the waiting statement's caller.
func watchIdleHolders(ctx context.Context, after time.Duration, look idleLook, report func(ended []Backend, err error)) (stop func()) {
	// Most statements are done before after, and cost no goroutine.
	return bg.RunAfter(ctx, after, func(stopping context.Context) {
		for stopping.Err() == nil {
			sctx, scancel := context.WithTimeout(stopping, idleHolderTimeout)
			lctx, lcancel := context.WithTimeout(ctx, idleHolderTimeout)
			ended, err := look(sctx, lctx)
			lcancel()
			scancel()
			if stopping.Err() != nil {
				err = nil // the statement is done: only what was ended matters
			}
			if len(ended) > 0 || err != nil {
				report(ended, err)
			}
			wait.Sleep(stopping, after)
		}
	}).Stop
}

// endIdleHolders ends and returns the sessions idle in a transaction for
// at least after that block backend waiter (nil behind PgBouncer) on the
// row of lease name, if it has expired or is free. A session it may not
// end or see is an error that names it; the others are ended all the same.
// ctx bounds the look; each ending is seen through until caller, its
// caller's context, ends, and wait.PastDeadline more.
func endIdleHolders(ctx, caller context.Context, db fence.DB, q *queries, name string, after time.Duration, waiter *int64) ([]Backend, error) {
	type found struct {
		b     Backend
		xid   *string
		since *time.Time
	}
	rows, err := db.Query(ctx, q.idleHolders, name, after.Microseconds(), waiter)
	if err != nil {
		return nil, err
	}
	all, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (f found, err error) {
		f.b, err = scanBackend(r, &f.xid, &f.since)
		return f, err
	})
	if err != nil {
		return nil, err
	}
	// Ending one frees the row, and the waiter may then end ctx: each
	// ending is seen through, to be counted, but by wait.PastDeadline past
	// caller's end at most: the caller waits for the look.
	kctx, cancel := wait.Outlive(caller, idleHolderTimeout)
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

// looker runs a client's looks, one at a time, on a connection of its own
// (waiting statements may hold every pooled one), opened on the first look
// and closed with the client. The connect runs beside the looks
// (ownconn.Link), so a look cut short does not cut it short: otherwise
// every short wait on a contended lease dials the server again, and the
// storm overflows a busy server's listen queue, holding up renewers'
// connects.
type looker struct {
	turn   chan struct{} // holds one token: the right to use link
	pool   *pgxpool.Pool
	ctx    context.Context // the client's group's: it ends the connect
	link   *ownconn.Link   // nil before the first look
	closed bool
}

// newLooker returns a looker on pool's server, whose connects end with ctx.
func newLooker(ctx context.Context, pool *pgxpool.Pool) *looker {
	l := &looker{turn: make(chan struct{}, 1), pool: pool, ctx: ctx}
	l.turn <- struct{}{}
	return l
}

// look is one endIdleHolders on ctx; it waits its turn, and the connect,
// only as long as stopping.
func (l *looker) look(stopping, ctx context.Context, q *queries, name string, after time.Duration, waiter *int64) ([]Backend, error) {
	select {
	case <-l.turn:
	case <-stopping.Done():
		return nil, stopping.Err()
	}
	defer func() { l.turn <- struct{}{} }()
	if l.closed {
		return nil, ErrClosed
	}
	if l.link == nil {
		l.link = ownconn.NewLink(l.ctx, l.pool, idleHolderTimeout)
	}
	var ended []Backend
	err := l.link.Do(stopping, idleHolderTimeout, func(_ context.Context, db pgexec.DB) (err error) {
		ended, err = endIdleHolders(ctx, ctx, db, q, name, after, waiter)
		return err
	})
	return ended, err
}

// close closes the connection after the look in progress; later looks
// fail with ErrClosed.
func (l *looker) close() {
	<-l.turn
	defer func() { l.turn <- struct{}{} }()
	l.closed = true
	if l.link != nil {
		l.link.Close()
	}
}

// watchIdleHolders watches the acquisition of lease name on backend
// waiter (Config.IdleHolderAfter).
func (c *Client) watchIdleHolders(ctx context.Context, name string, waiter *int64) (stop func()) {
	after := c.cfg.IdleHolderAfter
	look := func(stopping, ctx context.Context) ([]Backend, error) {
		c.stats.idleLooks.Add(1)
		return c.idle.look(stopping, ctx, c.q, name, after, waiter)
	}
	warned := false
	return watchIdleHolders(ctx, after, look, func(ended []Backend, err error) {
		if err != nil {
			c.stats.idleLookErrors.Add(1)
		}
		for _, b := range ended {
			c.stats.idleEnded.Add(1)
			c.emit(Event{Kind: IdleHolderEnded, Lease: name, Backend: &b})
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

// backendPID returns the PID of conn's backend if it is the one announced
// at connect, or nil (behind PgBouncer: a pooler's key).
func backendPID(ctx context.Context, conn *pgx.Conn) *int64 {
	var pid int64
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil || pid != int64(conn.PgConn().PID()) {
		return nil
	}
	return &pid
}
