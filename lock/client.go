package lock

import (
	"context"
	cryptorand "crypto/rand"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/schemaver"
	"github.com/pgfence/pgfence/internal/wait"
)

// Client acquires and renews leases. It is safe for concurrent use. Its
// background goroutines, each started when needed and stopped on its own
// when idle:
//   - the renewer, while it holds leases (it stops after one RenewInterval
//     without any), on a connection of its own;
//   - the release listener, while an Acquire waits or a Watch is open (it
//     lingers briefly after the last one ends), on a connection taken out of
//     the pool;
//   - the poller, while an Acquire waits;
//   - one per acquisition given up with its outcome unknown, which frees the
//     lease once the server has let go of it (at most 5s).
//
// Close stops them all and waits for them.
type Client struct {
	pool *pgxpool.Pool
	cfg  Config
	q    queries
	lis  *listener
	poll *poller

	mu       sync.Mutex
	held     map[*Lease]struct{}
	renewing bool
	closed   bool
	bg       *bg.Group // every background goroutine

	closeOnce sync.Once
	closeErr  error
	stats     stats

	verified atomic.Bool   // the schema version was checked
	backoff  retry.Backoff // after transient errors
	m        *metrics
	failing  atomic.Bool // renewals are failing (for the cause of a loss)
}

// New returns a client that keeps leases in pool's database. It validates cfg
// (see Config for defaults) and returns a *ConfigError naming the bad field.
// It does not touch the database: the first acquisition checks the schema.
func New(pool *pgxpool.Pool, cfg Config) (*Client, error) {
	if pool == nil {
		return nil, ErrNilPool
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := cfg.validatePool(pool.Config()); err != nil {
		return nil, err
	}
	c := &Client{
		pool:    pool,
		cfg:     cfg,
		q:       newQueries(cfg.Schema),
		held:    make(map[*Lease]struct{}),
		bg:      bg.New(context.Background()),
		backoff: retry.Backoff{Base: cfg.PollInterval, Max: 10 * cfg.PollInterval},
	}
	c.lis = newListener(c)
	c.poll = newPoller(c)
	m, err := newMetrics(c)
	if err != nil {
		return nil, err
	}
	c.m = m
	return c, nil
}

// Config returns the client's configuration with defaults filled in.
func (c *Client) Config() Config { return c.cfg }

// Pool returns the pool the client was built from.
func (c *Client) Pool() *pgxpool.Pool { return c.pool }

// TryAcquire acquires the lease name in one round trip if it is free, was
// released, or has expired at the database; otherwise it returns a *HeldError.
// The new lease's token is greater than every token issued for name before.
//
// The client's first acquisition checks that the schema is migrated and
// returns a *migrations.NotMigratedError if not. If ctx ends while the
// acquisition is in flight, the database may still have granted it: the
// client then frees that lease in the background (by its secret, which
// only this attempt knows), so nothing is left held by nobody.
func (c *Client) TryAcquire(ctx context.Context, name string) (*Lease, error) {
	if err := fence.ValidateName(name); err != nil {
		return nil, err
	}
	secret := newSecret()
	l, err := c.tryAcquire(ctx, name, secret, time.Time{})
	if pid, ok := inDoubt(err); ok {
		c.abandon(name, secret, pid)
	}
	return l, err
}

// newSecret returns a fresh per-acquisition secret.
func newSecret() []byte {
	secret := make([]byte, 16)
	_, _ = cryptorand.Read(secret)
	return secret
}

// errRowChanging is returned when three attempts in a row found the row
// changed between the acquisition and the look-up that followed it.
var errRowChanging = errors.New("the row kept changing under three attempts")

// inFlightError is the error of an acquisition statement that may have
// reached the server and got no answer (the context ended, or the connection
// broke): the database may still grant it. pid is the backend that ran it.
type inFlightError struct {
	pid uint32
	err error
}

func (e *inFlightError) Error() string { return e.err.Error() }
func (e *inFlightError) Unwrap() error { return e.err }

// inFlight wraps err in an *inFlightError when the statement sent on
// backend pid may nevertheless have been executed: no server answer says it
// failed, and it was not refused before being sent.
func inFlight(err error, pid uint32) error {
	var pg *pgconn.PgError
	if err == nil || errors.As(err, &pg) || pgconn.SafeToRetry(err) {
		return err
	}
	return &inFlightError{pid: pid, err: err}
}

// inDoubt reports whether a failed acquisition may nevertheless have been
// granted, and on which backend.
func inDoubt(err error) (pid uint32, ok bool) {
	var f *inFlightError
	if errors.As(err, &f) {
		return f.pid, true
	}
	return 0, false
}

// abandon frees the lease name if it is held with secret: an acquisition
// whose outcome is unknown, by a caller that has given up on it. Closing the
// client side of a connection does not stop the server: it still runs (and
// commits) what it had received, and may not even have started when the
// client gave up. So abandon first waits until backend pid has exited (pgx
// closed the connection; the backend ends once it has processed its input),
// then frees the lease by its secret (known only to that acquisition). If the
// backend lingers (a partition: its socket is not closed yet), it frees the
// lease at the end of wait.CleanupTimeout anyway, and the lease's TTL covers
// the rest. It runs in the background, owned by the client (Close waits).
func (c *Client) abandon(name string, secret []byte, pid uint32) {
	run := func() {
		ctx, cancel := wait.Detached(context.Background())
		defer cancel()
		wctx, wcancel := context.WithTimeout(ctx, wait.CleanupTimeout*4/5)
		_ = c.afterBackend(wctx, pid)
		wcancel()
		_, err := c.pool.Exec(ctx, c.q.releaseSecret, name, secret)
		if err != nil {
			c.cfg.Logger.Warn("pgfence: could not free an acquisition whose outcome was unknown; it expires by TTL",
				"lease", name, "err", err)
		}
	}
	// It must run even if Close has begun (it frees a lease): it ignores
	// the group's cancellation, and Close waits for it.
	if !c.bg.Go(func(context.Context) { run() }) {
		run()
	}
}

// afterBackend waits until backend pid has exited.
func (c *Client) afterBackend(ctx context.Context, pid uint32) error {
	for {
		var alive bool
		if err := c.pool.QueryRow(ctx, c.q.backendAlive, int64(pid)).Scan(&alive); err != nil {
			return err
		}
		if !alive {
			return nil
		}
		if !wait.Sleep(ctx, 5*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// verify checks the schema version once per client, on first use.
func (c *Client) verify(ctx context.Context) error {
	if c.verified.Load() {
		return nil
	}
	if err := schemaver.Verify(ctx, c.pool, c.cfg.Schema); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	var synced bool
	if err := c.pool.QueryRow(ctx, c.q.syncEpoch).Scan(&synced); err != nil {
		return fmt.Errorf("lock: token epoch: %w", c.explain(err))
	}
	if !synced {
		return nil // a standby: the acquisition will say so, and this runs again
	}
	c.verified.Store(true)
	return nil
}

// tryAcquire is TryAcquire with a given secret. Blocking Acquire keeps one
// secret across its attempts, so that when an attempt's reply is lost (its
// connection dropped after the commit) a later attempt finds the row holding
// its own secret and adopts the lease instead of waiting for it to expire.
// since is the send time of the first attempt with this secret (zero: this
// is the first); an adopted lease is trusted from then, the earliest moment
// the lost acquisition can have happened, since its reply time is unknown.
//
// A lease is returned only with a live trust window of at least one
// RenewInterval: an acquisition that took longer than that to come back
// (it waited behind a guarded transaction, or the process was paused) is
// renewed at once, and tried again if the renewal finds it gone.
func (c *Client) tryAcquire(ctx context.Context, name string, secret []byte, since time.Time) (l *Lease, err error) {
	defer func() {
		c.m.attempted(ctx, err)
		if l != nil {
			c.emit(Event{Kind: Acquired, Lease: name, Token: l.token})
		}
	}()
	if c.isClosed() {
		return nil, ErrClosed
	}
	if err := c.verify(ctx); err != nil {
		return nil, err
	}
	var (
		g    grant
		held *HeldError
	)
	args := []any{name, c.cfg.Holder, secret, c.cfg.TTL.Microseconds()}
	for attempt := 0; ; attempt++ {
		if attempt == 3 {
			if held != nil {
				return nil, held
			}
			return nil, fmt.Errorf("lock: acquire %q: %w", name, errRowChanging)
		}
		var (
			r   casResult
			err error
		)
		g, r, err = c.attempt(ctx, args, since)
		if err != nil {
			return nil, fmt.Errorf("lock: acquire %q: %w", name, c.explain(err))
		}
		if !r.won {
			if held = r.held; held != nil && r.live {
				return nil, held
			}
			continue // freed between the two statements, or an insert race
		}
		if !c.cfg.window().lateGrant(g.sent, time.Now()) {
			break
		}
		renewSent := time.Now()
		got, err := c.renewRows(ctx, c.pool, []string{name}, []int64{g.token}, [][]byte{secret})
		if err != nil {
			// Ours at the database, but not trustworthy: free it now
			// (synchronously, since a later attempt may use this secret).
			rctx, cancel := wait.Detached(ctx)
			_, _ = c.pool.Exec(rctx, c.q.releaseSecret, name, secret)
			cancel()
			return nil, fmt.Errorf("lock: acquire %q: renew the late acquisition: %w", name, err)
		}
		exp, ok := got[renewKey{name, fence.Token(g.token)}]
		if ok {
			g.sent, g.expiresAt = renewSent, exp
			break
		}
		// Expired at the database before the renewal: try again.
	}
	l = newLease(c, name, fence.Token(g.token), secret, g.expiresAt, g.sent)
	if !c.track(l) {
		// Closed while acquiring: give it straight back.
		_ = l.Release(context.WithoutCancel(ctx))
		return nil, ErrClosed
	}
	return l, nil
}

// grant is a won acquisition: its token, the database expiry, and the send
// time its trust window counts from.
type grant struct {
	token     int64
	expiresAt time.Time
	sent      time.Time
}

// attempt is one compare-and-set (and, for a name never acquired, the
// insert). r.won says whether the lease was won (g is then set); otherwise
// r.held is the row as it stands (nil when an insert lost a race: try
// again).
func (c *Client) attempt(ctx context.Context, args []any, since time.Time) (g grant, r casResult, err error) {
	name := args[0].(string)
	g.sent = time.Now()
	r, err = c.compareAndSet(ctx, args, &g.token, &g.expiresAt)
	switch {
	case err != nil || r.won:
		return g, r, err
	case r.held != nil && r.mine && r.live && c.cfg.window().adoptable(since, time.Now()):
		// An earlier attempt of this Acquire won; its reply was lost.
		c.cfg.Logger.Info("pgfence: adopted a lease whose acquisition reply was lost", "lease", name, "token", r.held.Token)
		return grant{token: int64(r.held.Token), expiresAt: r.held.ExpiresAt, sent: since}, casResult{won: true}, nil
	case r.held != nil:
		return g, r, nil
	}
	// No row yet: this is the name's first acquisition, unless someone
	// else inserts it first (no row returned); then try again.
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return g, casResult{}, err
	}
	defer conn.Release()
	err = conn.QueryRow(ctx, c.q.acquireNew, args...).Scan(&g.token, &g.expiresAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return g, casResult{}, nil
	}
	return g, casResult{won: err == nil}, inFlight(err, conn.Conn().PgConn().PID())
}

// casResult is what one compare-and-set round trip found.
type casResult struct {
	won  bool       // the acquire statement took the lease
	held *HeldError // otherwise, the row as heldBy saw it (nil: no row)
	live bool       // the row is held and unexpired
	mine bool       // the row holds the caller's secret
}

// compareAndSet sends the acquire statement and, if it did not win, heldBy.
// It reports whether the lease was won (filling token and expiresAt), or
// else the row as it stands, if there is one.
func (c *Client) compareAndSet(ctx context.Context, args []any, token *int64, expiresAt *time.Time) (casResult, error) {
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return casResult{}, err
	}
	defer conn.Release()
	err = conn.QueryRow(ctx, c.q.acquire, args...).Scan(token, expiresAt)
	switch {
	case err == nil:
		return casResult{won: true}, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return casResult{}, inFlight(err, conn.Conn().PgConn().PID())
	}
	var (
		r        casResult
		h        = &HeldError{Name: args[0].(string)}
		inMicros int64
	)
	err = conn.QueryRow(ctx, c.q.heldBy, args[0], args[2]).Scan(&h.Token, &h.Holder, &r.live, &h.ExpiresAt, &inMicros, &r.mine)
	switch {
	case err == nil:
		h.ExpiresIn = time.Duration(inMicros) * time.Microsecond
		r.held = h
		return r, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return casResult{}, err
	}
	return casResult{}, nil
}

// Acquire blocks until it acquires the lease name or ctx ends. It wakes
// within milliseconds of a release (LISTEN/NOTIFY) and otherwise retries
// every PollInterval (jittered), or sooner when the holder's lease is due to
// expire. It returns ctx's error when ctx ends first.
//
// Errors are classified (see the package documentation): a permanent one (a
// schema that is missing or too old, missing privileges) ends Acquire with
// that error at once; a transient one (a lost connection, a failover) is
// retried with capped exponential backoff and jitter, logged once when
// acquisitions start failing and once when they recover. If an attempt won
// the lease but its reply was lost, a later attempt recognises the lease as
// its own (Acquire keeps one secret across attempts) and returns it, trusted
// from the first attempt's send time, instead of waiting for it to expire;
// if Acquire gives up instead, it frees that lease in the background.
func (c *Client) Acquire(ctx context.Context, name string) (l *Lease, err error) {
	if err := fence.ValidateName(name); err != nil {
		return nil, err
	}
	var (
		sub *subscription
		w   *waiter
	)
	secret, since, began := newSecret(), time.Time{}, time.Now()
	var (
		doubt bool   // some attempt's outcome is unknown
		pid   uint32 // the backend of the last such attempt
	)
	defer func() {
		if sub != nil {
			sub.cancel()
		}
		if w != nil {
			c.poll.remove(w)
		}
		if err != nil && doubt {
			c.abandon(name, secret, pid)
		}
	}()
	var failing retry.Failing
	for {
		attemptAt := time.Now()
		l, err := c.tryAcquire(ctx, name, secret, since)
		if since.IsZero() {
			since = attemptAt
		}
		if p, ok := inDoubt(err); ok {
			doubt, pid = true, p
		}
		var held *HeldError
		if !errors.As(err, &held) {
			switch {
			case err == nil:
				failing.Recover(c.cfg.Logger, "pgfence: acquire recovered", "lease", name)
				c.m.waitTime.Record(ctx, time.Since(began).Seconds())
				return l, nil
			case ctx.Err() != nil:
				return nil, ctx.Err()
			case errors.Is(err, ErrClosed) || !(retry.Transient(err) || errors.Is(err, errRowChanging)):
				return nil, err
			}
			failing.Fail(c.cfg.Logger, "pgfence: acquire failing; retrying with backoff", err, "lease", name)
			if !wait.Sleep(ctx, c.backoff.Wait(failing.Count()-1)) {
				return nil, ctx.Err()
			}
			continue
		}
		failing.Recover(c.cfg.Logger, "pgfence: acquire recovered", "lease", name)
		// Waiting: subscribe to releases (once), then register with the
		// poller, which asks the holder's release to send a NOTIFY and
		// wakes w once that is done: the next attempt catches a release
		// that came before the request, the NOTIFY one after it. From then
		// on w wakes when the poller finds the lease free or expired, and
		// sub when it is released.
		if sub == nil {
			sub = c.lis.subscribe(name)
			select {
			case <-sub.ready:
			case <-time.After(c.cfg.PollInterval):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			w = c.poll.add(name)
		}
		select {
		case <-sub.C:
		case <-w.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Close releases every lease the client holds (their contexts are cancelled
// with ErrReleased) and stops its goroutines, then waits for them. Later
// acquisitions fail with ErrClosed. It returns the first release error. It
// runs once: later and concurrent calls wait for the first and return its
// result.
func (c *Client) Close(ctx context.Context) error {
	c.closeOnce.Do(func() { c.closeErr = c.close(ctx) })
	return c.closeErr
}

func (c *Client) close(ctx context.Context) error {
	c.mu.Lock()
	c.closed = true
	leases := make([]*Lease, 0, len(c.held))
	for l := range c.held {
		leases = append(leases, l)
	}
	c.mu.Unlock()
	var first error
	for _, l := range leases {
		if err := l.Release(ctx); err != nil && first == nil {
			first = err
		}
	}
	c.lis.stop()
	c.poll.close()
	c.bg.Stop() // cancel, then wait for every goroutine
	_ = c.m.observed.Unregister()
	return first
}

func (c *Client) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// track adds a lease to the renewal set and starts the renewer if needed.
func (c *Client) track(l *Lease) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.held[l] = struct{}{}
	if !c.renewing {
		c.renewing = c.bg.Go(c.renewLoop)
	}
	return true
}

func (c *Client) untrack(l *Lease) {
	c.mu.Lock()
	delete(c.held, l)
	c.mu.Unlock()
}

// explain adds what to do to a database error caused by the deployment: a
// role without pgfence's grants, or a schema without pgfence's tables.
func (c *Client) explain(err error) error {
	return hint.Wrap(err, c.cfg.Schema, c.pool.Config().ConnConfig.User)
}
