package lock

import (
	"context"
	cryptorand "crypto/rand"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/wait"
)

// Client acquires and renews leases. It is safe for concurrent use. A client
// runs one background goroutine while it holds leases (the renewer) and one
// while some Acquire is waiting (the release listener); both stop on their own
// when idle (the renewer after one RenewInterval without leases), and Close
// stops them at once.
type Client struct {
	pool *pgxpool.Pool
	cfg  Config
	q    queries
	lis  *listener

	mu       sync.Mutex
	held     map[*Lease]struct{}
	renewing bool
	kick     chan struct{} // wakes the renewer on Close
	closed   bool
	wg       sync.WaitGroup
	stats    stats
}

// New returns a client that keeps leases in pool's database. It validates cfg
// (see Config for defaults) and returns a *ConfigError naming the bad field.
func New(pool *pgxpool.Pool, cfg Config) (*Client, error) {
	if pool == nil {
		return nil, ErrNilPool
	}
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Client{
		pool: pool,
		cfg:  cfg,
		q:    newQueries(cfg.Schema),
		held: make(map[*Lease]struct{}),
		kick: make(chan struct{}, 1),
	}
	c.lis = newListener(c)
	return c, nil
}

// Config returns the client's configuration with defaults filled in.
func (c *Client) Config() Config { return c.cfg }

// Pool returns the pool the client was built from.
func (c *Client) Pool() *pgxpool.Pool { return c.pool }

// TryAcquire acquires the lease name in one round trip if it is free, was
// released, or has expired at the database; otherwise it returns a *HeldError.
// The new lease's token is greater than every token issued for name before.
func (c *Client) TryAcquire(ctx context.Context, name string) (*Lease, error) {
	if err := fence.ValidateName(name); err != nil {
		return nil, err
	}
	return c.tryAcquire(ctx, name, newSecret(), time.Time{})
}

// newSecret returns a fresh per-acquisition secret.
func newSecret() []byte {
	secret := make([]byte, 16)
	_, _ = cryptorand.Read(secret)
	return secret
}

// tryAcquire is TryAcquire with a given secret. Blocking Acquire keeps one
// secret across its attempts, so that when an attempt's reply is lost (its
// connection dropped after the commit) a later attempt finds the row holding
// its own secret and adopts the lease instead of waiting for it to expire.
// since is the send time of the first attempt with this secret (zero: this
// is the first); an adopted lease is trusted from then, the earliest moment
// the lost acquisition can have happened, since its reply time is unknown.
func (c *Client) tryAcquire(ctx context.Context, name string, secret []byte, since time.Time) (*Lease, error) {
	if c.isClosed() {
		return nil, ErrClosed
	}
	var (
		token     int64
		expiresAt time.Time
		sent      time.Time
		held      *HeldError
	)
	args := []any{name, c.cfg.Holder, secret, c.cfg.TTL.Microseconds()}
	for attempt := 0; ; attempt++ {
		if attempt == 3 {
			if held != nil {
				return nil, held
			}
			return nil, fmt.Errorf("lock: acquire %q: the row kept changing under three attempts", name)
		}
		sent = time.Now()
		r, err := c.compareAndSet(ctx, args, &token, &expiresAt)
		if err != nil {
			return nil, fmt.Errorf("lock: acquire %q: %w", name, err)
		}
		if r.won {
			break
		}
		if r.held != nil && r.mine && r.live && !since.IsZero() &&
			time.Until(since.Add(c.cfg.TTL-c.cfg.SafetyMargin)) > c.cfg.RenewInterval/2 {
			// An earlier attempt of this Acquire won; its reply was lost.
			token, expiresAt, sent = r.held.Token, r.held.ExpiresAt, since
			c.cfg.Logger.Info("pgfence: adopted a lease whose acquisition reply was lost", "lease", name, "token", token)
			break
		}
		if r.held != nil {
			held = r.held
			if r.live {
				return nil, held
			}
			// Freed between the two statements: try again.
			continue
		}
		// No row yet: this is the name's first acquisition, unless someone
		// else inserts it first (no row returned); then try again.
		err = c.pool.QueryRow(ctx, c.q.acquireNew, args...).Scan(&token, &expiresAt)
		if err == nil {
			break
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return nil, fmt.Errorf("lock: acquire %q: %w", name, err)
		}
	}
	l := newLease(c, name, fence.Token(token), secret, expiresAt, sent)
	if !c.track(l) {
		// Closed while acquiring: give it straight back.
		_ = l.Release(context.WithoutCancel(ctx))
		return nil, ErrClosed
	}
	return l, nil
}

// casResult is what one compare-and-set round trip found.
type casResult struct {
	won  bool       // the acquire statement took the lease
	held *HeldError // otherwise, the row as heldBy saw it (nil: no row)
	live bool       // the row is held and unexpired
	mine bool       // the row holds the caller's secret
}

// compareAndSet sends the acquire statement and, pipelined after it in the
// same round trip, heldBy. It reports whether the lease was won (filling
// token and expiresAt), or else the row as it stands, if there is one.
func (c *Client) compareAndSet(ctx context.Context, args []any, token *int64, expiresAt *time.Time) (casResult, error) {
	b := &pgx.Batch{}
	b.Queue(c.q.acquire, args...)
	b.Queue(c.q.heldBy, args[0], args[2])
	br := c.pool.SendBatch(ctx, b)
	errWon := br.QueryRow().Scan(token, expiresAt)
	var (
		r        casResult
		h        = &HeldError{Name: args[0].(string)}
		inMicros int64
	)
	errHeld := br.QueryRow().Scan(&h.Token, &h.Holder, &r.live, &h.ExpiresAt, &inMicros, &r.mine)
	if err := br.Close(); err != nil {
		return casResult{}, err
	}
	switch {
	case errWon == nil:
		return casResult{won: true}, nil
	case !errors.Is(errWon, pgx.ErrNoRows):
		return casResult{}, errWon
	case errHeld == nil:
		h.ExpiresIn = time.Duration(inMicros) * time.Microsecond
		r.held = h
		return r, nil
	case !errors.Is(errHeld, pgx.ErrNoRows):
		return casResult{}, errHeld
	}
	return casResult{}, nil
}

// Acquire blocks until it acquires the lease name or ctx ends. It wakes
// within milliseconds of a release (LISTEN/NOTIFY) and otherwise retries
// every PollInterval (jittered), or sooner when the holder's lease is due to
// expire. It returns ctx's error when ctx ends first. Transient errors
// (a lost connection, a failover) are logged and retried; if an attempt won
// the lease but its reply was lost, a later attempt recognises the lease as
// its own (Acquire keeps one secret across attempts) and returns it, trusted
// from the first attempt's send time, instead of waiting for it to expire.
func (c *Client) Acquire(ctx context.Context, name string) (*Lease, error) {
	if err := fence.ValidateName(name); err != nil {
		return nil, err
	}
	var sub *subscription
	defer func() {
		if sub != nil {
			sub.cancel()
		}
	}()
	secret, since := newSecret(), time.Time{}
	for {
		attemptAt := time.Now()
		l, err := c.tryAcquire(ctx, name, secret, since)
		if since.IsZero() {
			since = attemptAt
		}
		var held *HeldError
		if !errors.As(err, &held) {
			if err != nil && ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if err != nil && !errors.Is(err, ErrClosed) {
				// A transient failure (connection lost, failover): keep
				// trying until ctx ends, logging what happened.
				c.cfg.Logger.Warn("pgfence: acquire failed, retrying", "lease", name, "err", err)
				if !wait.Sleep(ctx, c.jitter(c.cfg.PollInterval)) {
					return nil, ctx.Err()
				}
				continue
			}
			return l, err
		}
		// Waiting: subscribe to releases (once), and ask the holder's
		// release to send a NOTIFY, for a little longer than the next wait.
		// After the first request, try again at once: a release that came
		// before the request is caught by that attempt, one after it by the
		// NOTIFY.
		first := sub == nil
		if first {
			sub = c.lis.subscribe(name)
			select {
			case <-sub.ready:
			case <-time.After(c.cfg.PollInterval):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		if err := c.markWaiting(ctx, name); err != nil && ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if first {
			continue
		}
		wait := c.jitter(c.cfg.PollInterval)
		if held.ExpiresIn >= 0 && held.ExpiresIn+time.Millisecond < wait {
			wait = held.ExpiresIn + time.Millisecond
		}
		t := time.NewTimer(wait)
		select {
		case <-sub.C:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
		t.Stop()
	}
}

func (c *Client) markWaiting(ctx context.Context, name string) error {
	_, err := c.pool.Exec(ctx, c.q.markWaiting, name, (2 * c.cfg.PollInterval).Microseconds())
	return err
}

// Close releases every lease the client holds (their contexts are cancelled
// with ErrReleased) and stops its goroutines. Later acquisitions fail with
// ErrClosed. It returns the first release error.
func (c *Client) Close(ctx context.Context) error {
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
	c.poke()
	c.lis.stop()
	c.wg.Wait()
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
		c.renewing = true
		c.wg.Add(1)
		go c.renewLoop()
	}
	return true
}

func (c *Client) untrack(l *Lease) {
	c.mu.Lock()
	delete(c.held, l)
	c.mu.Unlock()
}

func (c *Client) poke() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// jitter spreads d by ±25% so that many waiters do not retry in lockstep.
func (c *Client) jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return d
	}
	return d*3/4 + time.Duration(rand.Int64N(int64(d)/2+1))
}
