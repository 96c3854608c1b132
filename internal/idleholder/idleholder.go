// Package idleholder ends the sessions that hold up the takeover of an
// expired or free lease: a holder frozen inside a guarded transaction (a
// GC pause, SIGSTOP, a stalled VM) or cut off without a FIN keeps the lease
// row's KEY SHARE lock as long as its session lives, and the takeover's FOR
// UPDATE waits for it. Once the lease has expired, ending that session
// (which aborts its transaction: none of its writes commits) is all the
// takeover needs. Only a takeover that waits pays, where a server-side
// idle bound (fence.Guard.IdleTimeout) costs every guarded transaction
// 4-6% (BENCHMARKS.md).
//
// A look (End) finds the sessions idle in a transaction for a while that
// block a statement waiting on the lease row, and ends them; Watch repeats
// it while the statement waits; a Looker runs a client's looks one at a
// time on a connection of its own.
package idleholder

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/wait"
)

// Backend is a PostgreSQL session, from pg_stat_activity (lock.Backend has
// the same fields).
type Backend struct {
	PID         int
	Application string
	User        string
	State       string
	XactStart   time.Time
	Query       string
}

// Timeout bounds one look (and the sessions it ends).
const Timeout = 5 * time.Second

// DefaultAfter is lock.Config.IdleHolderAfter's default: a quarter of
// PollInterval keeps a frozen holder's takeover within TTL + 1.25
// PollInterval; the floor spares the server, the ceiling keeps the wait
// small beside the lease's own.
func DefaultAfter(ttl, poll time.Duration) time.Duration {
	return max(10*time.Millisecond, min(poll/4, ttl/10, time.Second))
}

// ErrClosed: the Looker was closed.
var ErrClosed = errors.New("idle-holder looker closed")

// Look is one look: it ends the idle holders it finds and returns them.
// stopping ends when the waiting statement is done, ctx when its caller
// gives up (both within Timeout): a query on ctx finishes rather than
// having its connection closed mid-query.
type Look func(stopping, ctx context.Context) ([]Backend, error)

// Watch runs look after after, and every after, until stop; report hears
// each look that ended a session or failed. stop waits for the look in
// progress; its one owner is the waiting statement's caller.
func Watch(ctx context.Context, after time.Duration, look Look, report func(ended []Backend, err error)) (stop func()) {
	// Most statements are done before after, and cost no goroutine.
	return bg.RunAfter(ctx, after, func(stopping context.Context) {
		for stopping.Err() == nil {
			sctx, scancel := context.WithTimeout(stopping, Timeout)
			lctx, lcancel := context.WithTimeout(ctx, Timeout)
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

// End ends and returns the sessions idle in a transaction for at least
// after that block backend waiter (nil behind PgBouncer) on the row of
// lease name in schema, if it has expired or is free. A session it may not
// end or see is an error that names it; the others are ended all the same.
// ctx bounds the look; each ending is seen through until caller, its
// caller's context, ends, and wait.PastDeadline more.
func End(ctx, caller context.Context, db pgexec.DB, schema, name string, after time.Duration, waiter *int64) ([]Backend, error) {
	type found struct {
		b     Backend
		xid   *string
		since *time.Time
	}
	rows, err := db.Query(ctx, findSQL(schema), name, after.Microseconds(), waiter)
	if err != nil {
		return nil, err
	}
	all, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (f found, err error) {
		f.b, err = scan(r, &f.xid, &f.since)
		return f, err
	})
	if err != nil {
		return nil, err
	}
	// Ending one frees the row, and the waiter may then end ctx: each
	// ending is seen through, to be counted, but by wait.PastDeadline past
	// caller's end at most: the caller waits for the look.
	kctx, cancel := wait.Outlive(caller, Timeout)
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
		switch err := db.QueryRow(kctx, endSQL, f.b.PID, *f.xid, *f.since).Scan(&gone); {
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

// Blockers lists the sessions that block backend pid.
func Blockers(ctx context.Context, db pgexec.DB, pid int64) ([]Backend, error) {
	rows, err := db.Query(ctx, blockersSQL, pid)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Backend, error) { return scan(r) })
}

// BackendPID returns the PID of conn's backend if it is the one announced
// at connect, or nil (behind PgBouncer: a pooler's key).
func BackendPID(ctx context.Context, conn *pgx.Conn) *int64 {
	var pid int64
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil || pid != int64(conn.PgConn().PID()) {
		return nil
	}
	return &pid
}

// scan reads the session a row of blockersSQL or findSQL begins with, and
// then the row's extra columns.
func scan(r pgx.Row, extra ...any) (Backend, error) {
	var (
		b  Backend
		at *time.Time
	)
	err := r.Scan(append([]any{&b.PID, &b.Application, &b.User, &b.State, &at, &b.Query}, extra...)...)
	if at != nil {
		b.XactStart = *at
	}
	return b, err
}

// Looker runs a client's looks, one at a time, on a connection of its own
// (waiting statements may hold every pooled one), opened on the first look
// and closed with the client. The connect runs beside the looks
// (ownconn.Link), so a look cut short does not cut it short: otherwise
// every short wait on a contended lease dials the server again, and the
// storm overflows a busy server's listen queue, holding up renewers'
// connects.
type Looker struct {
	turn   chan struct{} // holds one token: the right to use link
	pool   *pgxpool.Pool
	ctx    context.Context // the client's group's: it ends the connect
	link   *ownconn.Link   // nil before the first look
	closed bool
}

// NewLooker returns a Looker on pool's server, whose connects end with ctx.
func NewLooker(ctx context.Context, pool *pgxpool.Pool) *Looker {
	l := &Looker{turn: make(chan struct{}, 1), pool: pool, ctx: ctx}
	l.turn <- struct{}{}
	return l
}

// Look is one End on ctx; it waits its turn, and the connect, only as long
// as stopping.
func (l *Looker) Look(stopping, ctx context.Context, schema, name string, after time.Duration, waiter *int64) ([]Backend, error) {
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
		l.link = ownconn.NewLink(l.ctx, l.pool, Timeout)
	}
	var ended []Backend
	err := l.link.Do(stopping, Timeout, func(_ context.Context, db pgexec.DB) (err error) {
		ended, err = End(ctx, ctx, db, schema, name, after, waiter)
		return err
	})
	return ended, err
}

// Close closes the connection after the look in progress; later looks
// fail with ErrClosed.
func (l *Looker) Close() {
	<-l.turn
	defer func() { l.turn <- struct{}{} }()
	l.closed = true
	if l.link != nil {
		l.link.Close()
	}
}

// findSQL finds the sessions idle in a transaction for at least $2 µs that
// block a statement waiting on the row of lease $1, if it is not held. The
// waiter is found by its backend $3 (the row may have moved since it began
// to wait), or, behind PgBouncer ($3 NULL), by the row's tuple lock. Of what
// blocks it, only the transaction it waits on counts (not a table lock's
// holder: an open migration). A session whose state this role may not see
// has an empty state: reported, not ended. The transaction id and the moment it
// went idle pin what endSQL may end.
func findSQL(schema string) string {
	return `SELECT DISTINCT a.pid, coalesce(a.application_name, ''), coalesce(a.usename::text, ''), coalesce(a.state, ''),
       a.xact_start, left(coalesce(a.query, ''), 200), a.backend_xid::text, a.state_change
  FROM ` + ident.Table(schema, "pgfence_leases") + ` l
  JOIN pg_locks w ON w.relation = l.tableoid
   AND w.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
   AND (w.locktype = 'relation' AND w.pid::int8 = $3::int8
        OR w.locktype = 'tuple' AND w.page = (l.ctid::text::point)[0]::int AND w.tuple = (l.ctid::text::point)[1]::int)
  JOIN pg_stat_activity a ON a.pid = ANY (pg_blocking_pids(w.pid))
 WHERE l.name = $1 AND (l.session IS NULL OR EXISTS (
         SELECT FROM ` + ident.Table(schema, "pgfence_sessions") + ` s WHERE s.id = l.session AND s.expires_at <= now()))
   AND (a.state IS NULL
        OR a.state = 'idle in transaction' AND a.state_change <= now() - $2 * interval '1 microsecond'
           AND EXISTS (SELECT 1 FROM pg_locks x WHERE x.pid = w.pid AND NOT x.granted
                          AND x.locktype = 'transactionid' AND x.transactionid = a.backend_xid))`
}

// endSQL ends backend $1 if it is still idle in transaction $2 since $3.
const endSQL = `SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a
 WHERE a.pid = $1 AND a.backend_xid::text = $2 AND a.state = 'idle in transaction' AND a.state_change = $3`

// blockersSQL lists the sessions that block backend $1.
const blockersSQL = `SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.usename::text, ''), coalesce(a.state, ''),
       a.xact_start, left(coalesce(a.query, ''), 200)
  FROM pg_stat_activity a WHERE a.pid = ANY (pg_blocking_pids($1)) ORDER BY a.pid`
