// Package ownconn gives a background loop a database connection of its own,
// opened with a pool's settings but outside the pool, so that the loop never
// waits behind the pool's other users: renewals and heartbeats must not
// starve because jobs or waiting acquirers hold every pooled connection.
package ownconn

import (
	"context"

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
	conn, err := pgx.ConnectConfig(ctx, cfg)
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

// Close closes the connection, if open. The Conn can be used again.
func (c *Conn) Close() {
	if c.conn != nil {
		_ = c.conn.Close(context.Background())
		c.conn = nil
	}
}
