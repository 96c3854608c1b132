package lock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/idleholder"
	"github.com/pgfence/pgfence/internal/notify"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/schemaver"
	"github.com/pgfence/pgfence/internal/wait"
)

// Client acquires leases and keeps them alive through one session row at
// the database, which it renews in one statement whatever the number of
// leases. It is safe for concurrent use. Its background goroutines belong
// to one group, which Close stops: the renewer (while leases are held, and
// sessionLinger after), the release listener (while an Acquire waits or a
// Watch or Observe is open), the poller (while an Acquire waits), one per
// Observe, one per cleanup that outlives its caller (at most 5 s), and the
// idle-holder looks of acquisitions waiting on a lease row.
type Client struct {
	pool  *pgxpool.Pool
	cfg   Config
	log   *slog.Logger // cfg.Logger with the holder on every line
	q     *queries
	waits *notify.Hub // the waiters of Acquire, Watch and Observe (waiters.go)

	mu      sync.Mutex
	sess    *session // the current session, nil before the first acquisition and after one ends
	closed  bool
	turn    chan struct{} // holds one token: the right to start or renew the session
	bg      *bg.Group     // every background goroutine
	renewer *bg.Demand    // runs renewLoop while leases are held
	clock   clock.Clock   // trust windows and the renewals' pace; tests move it

	closeOnce sync.Once
	closed1   chan struct{} // closed once the first Close has released (closeErr and stopping set)
	closeErr  error         // the release's
	stopping  *bg.Task      // stops the goroutines
	stats     stats

	verified atomic.Bool   // the schema version was checked
	backoff  retry.Backoff // after transient errors
	m        *metrics
	failing  atomic.Bool        // renewals are failing (for the cause of a loss)
	idle     *idleholder.Looker // looks for idle holders that block acquisitions
	// backendPIDs: the PID a pooled connection announced is its backend's
	// (not behind PgBouncer); set by verify.
	backendPIDs atomic.Bool
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
		log:     cfg.Logger.With("holder", cfg.Holder),
		pool:    pool,
		cfg:     cfg,
		q:       sqlFor(cfg.Schema),
		bg:      bg.New(context.Background()),
		turn:    make(chan struct{}, 1),
		clock:   clock.Real(),
		backoff: retry.Backoff{Base: cfg.PollInterval, Max: 10 * cfg.PollInterval},
	}
	c.turn <- struct{}{}
	c.idle = idleholder.NewLooker(c.bg.Context(), pool)
	c.renewer = c.bg.Demand(c.renewLoop, max(cfg.RenewInterval, sessionLinger), clock.Real())
	c.waits = newWaiters(c)
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
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("lock: %w", c.explain(err))
	}
	c.backendPIDs.Store(idleholder.BackendPID(ctx, conn.Conn()) != nil)
	conn.Release()
	c.verified.Store(true)
	return nil
}

// Close releases every lease the client holds (their contexts are cancelled
// with ErrReleased), ends its session, stops its goroutines and waits for
// them until ctx ends. What is still under way then finishes in the
// background within wait.CleanupTimeout (5s), and Close returns an error
// that wraps ctx's; close the pool only once Close has returned nil (a
// later Close waits again). Later acquisitions fail with ErrClosed. It
// runs once: later calls wait for the first, as long as their own ctx
// allows, and return its result.
func (c *Client) Close(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "lock: Close"); err != nil {
		return err
	}
	first := false
	c.closeOnce.Do(func() { first, c.closed1 = true, make(chan struct{}) })
	if first {
		c.closeErr = c.close(ctx)
		close(c.closed1)
	}
	var released error
	select {
	case <-c.closed1:
		released = c.closeErr
		select {
		case <-c.stopping.Done():
			return released
		case <-ctx.Done():
		}
	case <-ctx.Done():
	}
	return errors.Join(released, fmt.Errorf("lock: Close: %w (its goroutines stop in the background, within %v)",
		context.Cause(ctx), wait.CleanupTimeout))
}

// close releases the leases, ends the session and starts stopping the
// goroutines (c.stopping, which every Close waits on).
func (c *Client) close(ctx context.Context) error {
	c.mu.Lock()
	c.closed = true
	s := c.sess
	c.mu.Unlock()
	first := c.releaseAll(ctx, s)
	c.waits.Close()
	c.stopping = bg.Run(context.Background(), func(context.Context) {
		c.bg.Stop() // cancel, then wait for every goroutine (each within its own bound)
		c.idle.Close()
		_ = c.m.observed.Unregister()
	})
	return first
}

// releaseAll ends s's leases, frees their rows and ends s, in one
// transaction: every lease free at once.
func (c *Client) releaseAll(ctx context.Context, s *session) error {
	if s == nil {
		return nil
	}
	names, tokens, secrets := identify(slices.DeleteFunc(s.held(), func(l *Lease) bool { return !l.end() }))
	s.end(CauseExpired, ErrClosed, nil) // nothing left to lose: stops its timer
	sql := c.q.releaseMany
	if c.cfg.DurableRelease {
		sql = c.q.releaseManyDurable
	}
	what := fmt.Sprintf("release %d leases", len(names))
	return c.cleanup(ctx, what, func(ctx context.Context) error {
		// Leases first, then the session row: the lock order of every
		// statement that takes both.
		b := &pgx.Batch{}
		if len(names) > 0 {
			b.Queue(sql, names, tokens, secrets)
		}
		b.Queue(c.q.endSession, s.id)
		return c.pool.SendBatch(ctx, b).Close()
	})
}

// cleanup runs f, work that must be done even once the caller's context
// has ended (freeing leases), under ctx (at most wait.CleanupTimeout); if
// ctx has ended, or ends while f runs, it hands f to the background
// (handOff) and waits only wait.PastDeadline more. f must be safe to run
// again.
func (c *Client) cleanup(ctx context.Context, what string, f func(ctx context.Context) error) error {
	if ctx.Err() == nil {
		fctx, cancel := context.WithTimeout(ctx, wait.CleanupTimeout)
		err := f(fctx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() == nil {
			return fmt.Errorf("lock: %s: %w", what, c.explain(err))
		}
	}
	done := c.handOff(ctx, what, f)
	tidy, cancel := wait.Tidy(ctx)
	defer cancel()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("lock: %s: %w", what, c.explain(err))
		}
		return nil
	case <-tidy.Done():
		return fmt.Errorf("lock: %s: %w (it goes on in the background, within %v; a lease it does not free expires by its TTL)",
			what, context.Cause(ctx), wait.CleanupTimeout)
	}
}

// handOff runs f in the client's group under wait.CleanupTimeout, even
// once Close has begun, and returns where its error arrives (a failure is
// also logged); once the group has stopped, on the caller's goroutine for
// wait.PastDeadline at most.
func (c *Client) handOff(ctx context.Context, what string, f func(ctx context.Context) error) <-chan error {
	done := make(chan error, 1)
	run := func(ctx context.Context) {
		err := f(ctx)
		if err != nil {
			c.log.Warn("pgfence: cleanup failed; a lease it did not free expires by its TTL", "what", what, "err", err)
		}
		done <- err
	}
	if !c.bg.Go(func(context.Context) {
		bctx, cancel := wait.Detached(ctx)
		defer cancel()
		run(bctx)
	}) {
		tctx, cancel := wait.Tidy(ctx)
		defer cancel()
		run(tctx)
	}
	return done
}

// state returns the client's current session (nil if none) and whether it is closed.
func (c *Client) state() (*session, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sess, c.closed
}

// track adds l to its session and wants the renewer, unless the client
// is closed or the session has ended.
func (c *Client) track(l *Lease) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || !l.s.add(l) {
		return false
	}
	c.renewer.Want()
	return true
}

// untrack removes l from its session; the renewer idles once it holds none.
func (c *Client) untrack(l *Lease) {
	left := l.s.remove(l)
	c.mu.Lock()
	if left == 0 && (c.sess == nil || c.sess == l.s) {
		c.renewer.Idle()
	}
	c.mu.Unlock()
}

// explain adds what to do to an error the deployment caused (missing
// grants or tables).
func (c *Client) explain(err error) error {
	return hint.Wrap(err, c.cfg.Schema, c.pool.Config().ConnConfig.User)
}
