// Package ownconn gives a background loop a database connection of its own,
// opened with a pool's settings but outside the pool, so that the loop never
// waits behind the pool's other users: renewals and heartbeats must not
// starve because jobs or waiting acquirers hold every pooled connection.
// With several hosts it dials them all at once (Dial), so that a host that
// hangs during a failover does not hold the renewer past its trust window.
package ownconn

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
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
