package lock

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/idleholder"
	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/wait"
)

// ErrNoLease is returned by ForceRelease and Inspect for a name that has
// never been acquired.
var ErrNoLease = errors.New("lock: no such lease")

// Info describes a lease row, for operators. In JSON (MarshalJSON) it is
// the shape `pgfence leases --json` prints and the status page serves.
type Info struct {
	// Name is the lease name.
	Name string
	// Token is the newest token issued for the lease.
	Token fence.Token
	// Holder is the current holder, "" if the lease is free.
	Holder string
	// Held reports whether the lease is held and unexpired (database clock).
	Held bool
	// AcquiredAt, RenewedAt and ExpiresAt are database times.
	AcquiredAt time.Time
	RenewedAt  time.Time
	ExpiresAt  time.Time
	// ExpiresIn is ExpiresAt minus the database's clock when read
	// (negative once expired).
	ExpiresIn time.Duration
	// HeldFor is how long the current holder has held it (0 if free).
	HeldFor time.Duration
}

// MarshalJSON writes the lease with its token as a decimal string and its
// durations in seconds: {"name", "holder", "token", "held", "acquired_at",
// "renewed_at", "expires_at", "expires_in_seconds", "held_for_seconds"}.
func (i Info) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Name             string      `json:"name"`
		Holder           string      `json:"holder"`
		Token            fence.Token `json:"token"`
		Held             bool        `json:"held"`
		AcquiredAt       time.Time   `json:"acquired_at"`
		RenewedAt        time.Time   `json:"renewed_at"`
		ExpiresAt        time.Time   `json:"expires_at"`
		ExpiresInSeconds float64     `json:"expires_in_seconds"`
		HeldForSeconds   float64     `json:"held_for_seconds"`
	}{i.Name, i.Holder, i.Token, i.Held, i.AcquiredAt, i.RenewedAt, i.ExpiresAt, i.ExpiresIn.Seconds(), i.HeldFor.Seconds()})
}

// Leases lists every lease row in schema ("" means "pgfence"), by name,
// through any executor (a pool, a connection, a transaction).
func Leases(ctx context.Context, db fence.DB, schema string) ([]Info, error) {
	q, err := operatorStart(ctx, "lock: Leases", pgexec.NotNil(db, "lock: Leases"), schema)
	if err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, q.inspectAll)
	if err != nil {
		return nil, fmt.Errorf("lock: list leases: %w", explainFor(db, schema, err))
	}
	infos, err := pgx.CollectRows(rows, scanInfo)
	if err != nil {
		return nil, fmt.Errorf("lock: list leases: %w", explainFor(db, schema, err))
	}
	return infos, nil
}

// Inspect reads who holds the lease name in schema ("" means "pgfence")
// now, with which token, since and until when (database clock); Info.Held
// is false when it is free or expired. A name never acquired is ErrNoLease.
func Inspect(ctx context.Context, db fence.DB, schema, name string) (Info, error) {
	q, err := operatorStart(ctx, "lock: Inspect", pgexec.NotNil(db, "lock: Inspect"), schema, name)
	if err != nil {
		return Info{}, err
	}
	rows, err := db.Query(ctx, q.inspectOne, name)
	if err != nil {
		return Info{}, fmt.Errorf("lock: inspect %q: %w", name, explainFor(db, schema, err))
	}
	i, err := pgx.CollectExactlyOneRow(rows, scanInfo)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Info{}, fmt.Errorf("%w: %q", ErrNoLease, name)
	case err != nil:
		return Info{}, fmt.Errorf("lock: inspect %q: %w", name, explainFor(db, schema, err))
	}
	return i, nil
}

// operatorStart checks an operator function's ctx, executor (dbErr: why it
// is missing), schema and names, and returns schema's statements.
func operatorStart(ctx context.Context, what string, dbErr error, schema string, names ...string) (*queries, error) {
	if err := ctxcheck.NotNil(ctx, what); err != nil {
		return nil, err
	}
	if dbErr != nil {
		return nil, dbErr
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("lock: %w", err)
	}
	for _, name := range names {
		if err := fence.ValidateName(name); err != nil {
			return nil, err
		}
	}
	return sqlFor(schema), nil
}

// explainFor is Client.explain for the operators' functions.
func explainFor(db any, schema string, err error) error {
	return hint.Wrap(err, ident.Schema(schema), hint.Role(db))
}

// scanInfo reads one row of the inspect statements.
func scanInfo(r pgx.CollectableRow) (Info, error) {
	var (
		i   Info
		tok int64
		now time.Time
	)
	err := r.Scan(&i.Name, &tok, &i.Holder, &i.Held, &i.AcquiredAt, &i.RenewedAt, &i.ExpiresAt, &now)
	i.Token = fence.Token(tok)
	i.ExpiresIn = i.ExpiresAt.Sub(now)
	if i.Holder != "" {
		i.HeldFor = now.Sub(i.AcquiredAt)
	}
	return i, err
}

// Freed is what ForceRelease did.
type Freed struct {
	// Holder is the holder the lease had ("" if it was free).
	Holder string
	// Token is the lease's current token.
	Token fence.Token
	// Ended lists the sessions ForceRelease ended because they sat idle
	// in a transaction on the row of the expired lease and blocked it
	// (a holder frozen inside a guarded transaction); usually none.
	Ended []Backend
}

// ForceRelease frees the lease name in schema ("" means "pgfence"),
// whoever holds it: the holder learns it at its next renewal, and the next
// acquisition gets a greater token. It returns the previous holder, the
// current token and the sessions it ended, or ErrNoLease.
//
// Like a takeover, it waits for the guarded transactions of the current
// token, ending those that sit idle for 250 ms once the lease has expired
// (Config.IdleHolderAfter, whose rights pool's role needs). If ctx ends first, it cancels its statement at
// the server and returns a *BlockedError naming the sessions it waited for
// (none behind PgBouncer). It takes a pool: it needs a connection whose
// statement it can cancel.
func ForceRelease(ctx context.Context, pool *pgxpool.Pool, schema, name string) (Freed, error) {
	return forceRelease(ctx, pool, schema, name, nil)
}

// forceRelease is ForceRelease; looked, if not nil, hears each look's error.
func forceRelease(ctx context.Context, pool *pgxpool.Pool, schema, name string, looked func(error)) (Freed, error) {
	var noPool error
	if pool == nil {
		noPool = ErrNilPool
	}
	q, err := operatorStart(ctx, "lock: ForceRelease", noPool, schema, name)
	if err != nil {
		return Freed{}, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return Freed{}, fmt.Errorf("lock: force release %q: %w", name, explainFor(pool, schema, err))
	}
	defer conn.Release()
	waiter := idleholder.BackendPID(ctx, conn.Conn()) // the statement's backend; nil behind PgBouncer
	// The statement outlives ctx: stmt.Stop ends it, after the blockers
	// are looked up.
	qctx := context.WithoutCancel(ctx)
	var r struct {
		holder string
		token  int64
		err    error
	}
	stmt := bg.Run(qctx, func(qctx context.Context) {
		r.err = conn.QueryRow(qctx, q.forceRelease, name).Scan(&r.token, &r.holder, nil) // the last column: whether waiters were woken
	})
	defer stmt.Stop()
	own := ownconn.New(pool)
	defer own.Close()
	var ended []Backend // appended to on the watcher's goroutine, read once stopWatch returned
	// The looks stop when the statement is done or ctx ends; one ending a
	// session sees it through as long as ctx allows, and wait.PastDeadline
	// more (idleholder.End).
	stopWatch := idleholder.Watch(ctx, forceReleaseIdleAfter, func(stopping, lctx context.Context) ([]idleholder.Backend, error) {
		ended, err := idleholder.End(stopping, lctx, own, schema, name, forceReleaseIdleAfter, waiter)
		if looked != nil {
			looked(err)
		}
		return ended, err
	}, func(e []idleholder.Backend, _ error) { ended = append(ended, backends(e)...) })
	defer stopWatch()
	select {
	case <-stmt.Done():
	case <-ctx.Done():
		// Within wait.PastDeadline: name the blockers and cancel the
		// statement at the server (closing the connection would leave the
		// backend waiting, to free the lease later, unasked), while the
		// looks, which ctx ended too, stop.
		bctx, bcancel := wait.Tidy(ctx)
		defer bcancel()
		var (
			blocking []Backend
			berr     error
		)
		if waiter != nil { // behind PgBouncer the blocked backend is not known
			var found []idleholder.Backend
			found, berr = idleholder.Blockers(bctx, pool, *waiter)
			blocking = backends(found)
		}
		_ = conn.Conn().PgConn().CancelRequest(bctx)
		select {
		case <-stmt.Done():
		case <-bctx.Done():
			stmt.Stop() // the statement's context is cancelled: pgx returns at once
			berr = errors.Join(berr, errors.New("the server did not confirm the cancel in time: "+
				"the lease may still be freed when it gets it"))
		}
		stopWatch()
		if r.err != nil {
			be := &BlockedError{Name: name, Backends: blocking, Err: ctx.Err()}
			if berr != nil {
				return Freed{}, fmt.Errorf("%w (%v)", be, berr)
			}
			return Freed{}, be
		}
	}
	stopWatch() // the look in progress has reported: ended is complete
	if errors.Is(r.err, pgx.ErrNoRows) {
		return Freed{}, fmt.Errorf("%w: %q", ErrNoLease, name)
	}
	if r.err != nil {
		return Freed{}, fmt.Errorf("lock: force release %q: %w", name, explainFor(pool, schema, r.err))
	}
	return Freed{Holder: r.holder, Token: fence.Token(r.token), Ended: ended}, nil
}

// RevokeTx ends lease name's current term inside tx by issuing it a new
// token that nobody holds: once tx commits, the lease is free (waiters are
// woken), its holder's next renewal ends it, and its guarded writes are
// refused. Until then tx holds the lease row, and token guards what tx
// writes (a resource fenced by the lease's tokens accepts it). It waits,
// as an acquisition does, for the guarded transactions of the current
// token, as long as ctx allows. holder is the holder the row named (""
// if released, an expired holder's name if expired). A lease never
// acquired is ErrNoLease.
func RevokeTx(ctx context.Context, tx pgx.Tx, schema, name string) (token fence.Token, holder string, err error) {
	q, err := operatorStart(ctx, "lock: RevokeTx", pgexec.NotNil(tx, "lock: RevokeTx"), schema, name)
	if err != nil {
		return 0, "", err
	}
	var tok int64
	err = tx.QueryRow(ctx, q.revoke, []string{name}).Scan(&tok, &holder, nil) // the last column: whether waiters were woken
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, "", fmt.Errorf("%w: %q", ErrNoLease, name)
	}
	if err != nil {
		return 0, "", fmt.Errorf("lock: revoke %q: %w", name, explainFor(tx, schema, err))
	}
	return fence.Token(tok), holder, nil
}

// RevokeAllTx is RevokeTx for each of names that has been acquired, in one
// statement, and returns how many it revoked.
func RevokeAllTx(ctx context.Context, tx pgx.Tx, schema string, names []string) (int, error) {
	q, err := operatorStart(ctx, "lock: RevokeAllTx", pgexec.NotNil(tx, "lock: RevokeAllTx"), schema, names...)
	if err != nil {
		return 0, err
	}
	tag, err := tx.Exec(ctx, q.revoke, names)
	if err != nil {
		return 0, fmt.Errorf("lock: revoke %d leases: %w", len(names), explainFor(tx, schema, err))
	}
	return int(tag.RowsAffected()), nil
}
