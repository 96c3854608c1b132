// Package ownconn gives a background loop a database connection of its own,
// opened with a pool's settings but outside the pool, so that the loop does
// not wait behind the pool's other users: renewals and heartbeats must not
// starve because jobs or waiting acquirers hold every pooled connection
// (Link falls back to an idle pooled connection only while its own cannot
// open).
// With several hosts it dials them all at once (Dial), so that a host that
// hangs during a failover does not hold the renewer past its trust window.
package ownconn

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/retry"
)

// Conn is a connection owned by one goroutine. It is opened on first use
// (with the pool's connection settings and connect hooks, but not counted
// against its MaxConns) and again after it broke. It is not safe for
// concurrent use.
type Conn struct {
	pool *pgxpool.Pool
	conn *pgx.Conn
}

// New returns an unopened connection from pool.
func New(pool *pgxpool.Pool) *Conn { return &Conn{pool: pool} }

func (c *Conn) get(ctx context.Context) (*pgx.Conn, error) {
	if c.conn != nil && !c.conn.IsClosed() {
		return c.conn, nil
	}
	c.Close()
	pcfg := c.pool.Config()
	cfg := pcfg.ConnConfig.Copy()
	if pcfg.BeforeConnect != nil {
		if err := pcfg.BeforeConnect(ctx, cfg); err != nil {
			return nil, err
		}
	}
	conn, err := Dial(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if pcfg.AfterConnect != nil {
		if err := pcfg.AfterConnect(ctx, conn); err != nil {
			_ = conn.Close(ctx)
			return nil, err
		}
	}
	c.conn = conn
	return c.conn, nil
}

// Dial connects with cfg. With several hosts (a multi-host URL, as in front
// of Patroni), it tries them all at once and keeps the first that connects
// and passes the config's ValidateConnect (target_session_attrs), instead of
// one after the other as pgx does: a host that does not answer then costs
// nothing, where pgx would spend its whole connect_timeout on it before
// trying the next. The losing attempts are cancelled and closed.
func Dial(ctx context.Context, cfg *pgx.ConnConfig) (*pgx.Conn, error) {
	hosts := perHost(cfg)
	if len(hosts) <= 1 {
		return pgx.ConnectConfig(ctx, cfg)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type result struct {
		conn *pgx.Conn
		err  error
	}
	results := make(chan result, len(hosts))
	for _, h := range hosts {
		go func() {
			conn, err := pgx.ConnectConfig(ctx, h)
			results <- result{conn, err}
		}()
	}
	var (
		won  *pgx.Conn
		errs []error
	)
	for range hosts {
		r := <-results
		switch {
		case r.err != nil:
			errs = append(errs, r.err)
		case won == nil:
			won = r.conn
			cancel() // the others give up; their results are still drained
		default:
			_ = r.conn.Close(context.Background())
		}
	}
	if won != nil {
		return won, nil
	}
	return nil, errors.Join(errs...)
}

// Hosts is the number of distinct hosts cfg connects to (a multi-host URL
// has several).
func Hosts(cfg *pgx.ConnConfig) int { return len(perHost(cfg)) }

// perHost splits cfg into one config per host, each with that host's own
// fallbacks (TLS, then plain text, for sslmode=prefer) in their order.
func perHost(cfg *pgx.ConnConfig) []*pgx.ConnConfig {
	type hostPort struct {
		host string
		port uint16
	}
	first := hostPort{cfg.Host, cfg.Port}
	byHost := map[hostPort][]*pgconn.FallbackConfig{}
	order := []hostPort{first}
	for _, fb := range cfg.Fallbacks {
		k := hostPort{fb.Host, fb.Port}
		if _, seen := byHost[k]; !seen && k != first {
			order = append(order, k)
		}
		byHost[k] = append(byHost[k], fb)
	}
	out := make([]*pgx.ConnConfig, 0, len(order))
	for i, k := range order {
		h := cfg.Copy()
		fbs := byHost[k]
		if i > 0 { // the first of this host's fallbacks becomes the main config
			h.Host, h.Port, h.TLSConfig = fbs[0].Host, fbs[0].Port, fbs[0].TLSConfig
			fbs = fbs[1:]
		}
		h.Fallbacks = fbs
		out = append(out, h)
	}
	return out
}

// Open opens the connection if it is not open (never opened, or broken).
func (c *Conn) Open(ctx context.Context) error {
	_, err := c.get(ctx)
	return err
}

// IsOpen reports whether the connection is open.
func (c *Conn) IsOpen() bool { return c.conn != nil && !c.conn.IsClosed() }

// Query runs sql on the connection. Read the rows before the next call.
func (c *Conn) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	conn, err := c.get(ctx)
	if err != nil {
		return nil, err
	}
	return conn.Query(ctx, sql, args...)
}

// Exec runs sql on the connection.
func (c *Conn) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	conn, err := c.get(ctx)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return conn.Exec(ctx, sql, args...)
}

// QueryRow runs sql on the connection; a failed connect shows in Scan.
func (c *Conn) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	conn, err := c.get(ctx)
	if err != nil {
		return errRow{err}
	}
	return conn.QueryRow(ctx, sql, args...)
}

// Begin starts a transaction on the connection.
func (c *Conn) Begin(ctx context.Context) (pgx.Tx, error) {
	conn, err := c.get(ctx)
	if err != nil {
		return nil, err
	}
	return conn.Begin(ctx)
}

// errRow is a row whose Scan returns err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// Close closes the connection, if open. The Conn can be used again.
func (c *Conn) Close() {
	if c.conn != nil {
		_ = c.conn.Close(context.Background())
		c.conn = nil
	}
}

// Link is a background loop's connection of its own, opened beside the
// loop's path: one connect attempt at a time runs on a goroutine the Link
// owns, each bounded. Do runs the loop's statements on it, and only when
// it cannot open in time on one of the pool's idle connections, which
// still answer when new connections stall (a busy server's listen queue
// overflowing, a path that drops SYNs). It is not safe for concurrent use:
// one loop owns it.
type Link struct {
	pool    *pgxpool.Pool
	ctx     context.Context
	bound   time.Duration
	conn    *Conn       // open, or nil
	opening *bg.Task    // the attempt in flight, or nil
	opened  chan opened // its result
}

// opened is a connect attempt's result.
type opened struct {
	conn *Conn // nil if it failed
	err  error
	at   time.Time // when it ended
}

// NewLink returns a link to pool's server and starts its first connect;
// each attempt is bounded by bound, and every one ends with ctx or Close.
func NewLink(ctx context.Context, pool *pgxpool.Pool, bound time.Duration) *Link {
	l := &Link{pool: pool, ctx: ctx, bound: bound, opened: make(chan opened, 1)}
	l.open()
	return l
}

// open starts a connect attempt.
func (l *Link) open() {
	l.opening = bg.Run(l.ctx, func(ctx context.Context) {
		conn := New(l.pool)
		ctx, cancel := context.WithTimeout(ctx, l.bound)
		defer cancel()
		err := conn.Open(ctx)
		if err != nil {
			conn.Close()
			conn = nil
		}
		l.opened <- opened{conn, err, time.Now()}
	})
}

// pollIdle is how often Do looks for an idle pooled connection, and for
// the connect's result, once it may fall back to the pool.
const pollIdle = 20 * time.Millisecond

// Do runs fn on the link's own connection if it is open or opens within
// wait. If not (new connections stall), it runs fn on an idle connection
// of the pool, looked for every pollIdle, with fn's context bounded by
// wait: it may be a connection to a server that is gone, as after a
// failover. A pooled run that fails for want of an answer is tried again,
// on the link's own connection if it has opened meanwhile, else on another
// idle one (at once if the failed one broke, otherwise wait later), until
// ctx ends: fn must be safe to run again. A connect is kept in flight all
// along (a failed one is tried again wait/2 after it failed): after a
// failover, its dial of every host at once is what finds the new primary
// soonest. Do itself opens none of the pool's connections; the pool's
// acquire hooks run on fn's bounded context.
func (l *Link) Do(ctx context.Context, wait time.Duration, fn func(ctx context.Context, db pgexec.DB) error) error {
	tick := time.NewTicker(pollIdle)
	defer tick.Stop()
	var (
		connectErr, pooledErr error
		nextOpen              time.Time
		nextPool              = time.Now().Add(wait)
	)
	for {
		if l.conn != nil && !l.conn.IsOpen() {
			l.conn.Close()
			l.conn = nil
		}
		if l.conn != nil {
			err := fn(ctx, l.conn)
			if !l.conn.IsOpen() {
				l.conn.Close()
				l.conn = nil
				l.open() // at once, for the next call
			}
			return err
		}
		if l.opening == nil && !time.Now().Before(nextOpen) {
			l.open()
		}
		if !time.Now().Before(nextPool) {
			if ran, broke, err := l.onIdle(ctx, wait, fn); ran {
				if err == nil || ctx.Err() != nil || !(errors.Is(err, context.DeadlineExceeded) || retry.Transient(err)) {
					return err
				}
				pooledErr, nextPool = err, time.Now().Add(wait)
				if broke {
					nextPool = time.Now()
				}
			}
		}
		select {
		case r := <-l.opened:
			l.opening.Stop() // done: returns at once
			l.conn, l.opening = r.conn, nil
			if r.conn == nil {
				connectErr, nextOpen = r.err, r.at.Add(wait/2)
			}
		case <-tick.C:
		case <-ctx.Done():
			return errors.Join(ctx.Err(), connectErr, pooledErr)
		}
	}
}

// onIdle runs fn on an idle connection of the pool, with a context bounded
// by wait, if the pool has one (ran), and reports whether that connection
// broke.
func (l *Link) onIdle(ctx context.Context, wait time.Duration, fn func(ctx context.Context, db pgexec.DB) error) (ran, broke bool, err error) {
	if l.pool.Stat().IdleConns() == 0 {
		return false, false, nil
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	all := l.pool.AcquireAllIdle(ctx)
	if len(all) == 0 {
		return false, false, nil
	}
	for _, pc := range all[1:] {
		pc.Release()
	}
	pc := all[0]
	defer pc.Release()
	err = fn(ctx, pc)
	return true, pc.Conn().IsClosed(), err
}

// Close stops the attempt in flight, waiting for it, and closes the
// connection.
func (l *Link) Close() {
	if l.opening != nil {
		l.opening.Stop()
		if r := <-l.opened; r.conn != nil {
			r.conn.Close()
		}
		l.opening = nil
	}
	if l.conn != nil {
		l.conn.Close()
		l.conn = nil
	}
}
