package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// counter is a pgx tracer that counts what a pool sends: round trips (a
// query, or a batch) and statements (a query, or each of a batch's).
type counter struct{ trips, statements atomic.Int64 }

func (c *counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.trips.Add(1)
	c.statements.Add(1)
	return ctx
}

func (c *counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *counter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.trips.Add(1)
	return ctx
}

func (c *counter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	c.statements.Add(1)
}

func (c *counter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// ticksPerSecond is Linux's USER_HZ, the unit of /proc/<pid>/stat's CPU
// times (100 on every architecture Go supports).
const ticksPerSecond = 100

// serverCPU returns the CPU time used so far by the local PostgreSQL server:
// every process named postgres, with the children it has reaped (the
// postmaster reaps backends that exit), or false if there is none (the server
// is not on this machine, or /proc is not readable).
func serverCPU() (time.Duration, bool) {
	dirs, _ := filepath.Glob("/proc/[0-9]*/stat")
	var ticks int64
	found := false
	for _, p := range dirs {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		open, closing := bytes.IndexByte(raw, '('), bytes.LastIndexByte(raw, ')')
		if open < 0 || closing < open || string(raw[open+1:closing]) != "postgres" {
			continue
		}
		// After the command: state (field 3), ..., utime (14), stime (15),
		// cutime (16), cstime (17).
		f := strings.Fields(string(raw[closing+1:]))
		if len(f) < 15 {
			continue
		}
		for _, v := range f[11:15] {
			n, _ := strconv.ParseInt(v, 10, 64)
			ticks += n
		}
		found = true
	}
	return time.Duration(ticks) * time.Second / ticksPerSecond, found
}

// clientCPU returns the CPU time this process has used so far.
func clientCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// walMark is the server's WAL position and record count at one moment.
type walMark struct {
	bytes, records int64
}

// wal reads the WAL position and pg_stat_wal's record count. Backends report
// their WAL statistics when they exit or at most once a second, so a caller
// that wants exact counts closes the pool's connections first (flushed).
func (b *bench) wal(ctx context.Context) (walMark, error) {
	var m walMark
	err := b.pool.QueryRow(ctx, "SELECT pg_current_wal_lsn() - '0/0', wal_records FROM pg_stat_wal").Scan(&m.bytes, &m.records)
	return m, err
}

// flushed closes the pool's connections, so that their backends exit and
// report their statistics, and waits for them to be gone. (Connections a
// lease client has taken out of the pool for itself stay.)
func (b *bench) flushed(ctx context.Context) error {
	var pids []uint32
	for _, c := range b.pool.AcquireAllIdle(ctx) {
		pids = append(pids, c.Conn().PgConn().PID())
		c.Release()
	}
	b.pool.Reset()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var n int
		err := b.pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)", pids).Scan(&n)
		if err != nil || n == 0 {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d backends still there 5s after their connections closed", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// cost is what one op cost, on average over a measurement.
type cost struct {
	perSecond            float64
	trips, statements    float64
	walRecords, walBytes float64
	serverCPU, clientCPU time.Duration
	serverKnown          bool
}

// costOf runs f with clients for d and returns its cost per counted op.
func (b *bench) costOf(ctx context.Context, f form, clients int, d time.Duration) (cost, error) {
	if err := b.flushed(ctx); err != nil {
		return cost{}, err
	}
	w0, err := b.wal(ctx)
	if err != nil {
		return cost{}, err
	}
	t0, s0 := b.sent.trips.Load(), b.sent.statements.Load()
	sc0, known0 := serverCPU()
	cc0 := clientCPU()
	n, took, err := count(ctx, f, clients, false, d)
	if err != nil {
		return cost{}, err
	}
	cc1 := clientCPU()
	sc1, known1 := serverCPU()
	t1, s1 := b.sent.trips.Load(), b.sent.statements.Load()
	if err := b.flushed(ctx); err != nil {
		return cost{}, err
	}
	w1, err := b.wal(ctx)
	if err != nil {
		return cost{}, err
	}
	ops := float64(max(n, 1))
	return cost{
		perSecond:   float64(n) / took.Seconds(),
		trips:       float64(t1-t0) / ops,
		statements:  float64(s1-s0) / ops,
		walRecords:  float64(w1.records-w0.records) / ops,
		walBytes:    float64(w1.bytes-w0.bytes) / ops,
		serverCPU:   time.Duration(float64(sc1-sc0) / ops),
		clientCPU:   time.Duration(float64(cc1-cc0) / ops),
		serverKnown: known0 && known1,
	}, nil
}

// costs writes, for each form, what one op costs the server and the client:
// the evidence for the ratios of the tables above.
func (b *bench) costs(ctx context.Context, out *bytes.Buffer, d time.Duration) error {
	fmt.Fprint(out, "\n### Where the time goes\n\nOne measurement per form and client count (distinct names; many leases), "+
		d.String()+" each, with what it cost per op: round trips and statements the client sent (a pgx tracer; Redis: –), "+
		"WAL records (`pg_stat_wal`, read after the connections closed so that every backend reported) and bytes (the WAL "+
		"position), the CPU time of every `postgres` process (`/proc`, with the backends that exited), and this process's "+
		"CPU time (client and its goroutines). Server and client share the 2 cores.\n")
	pairs, _ := b.pairForms()
	guards, _, done, err := b.guardForms(0)
	if err != nil {
		return err
	}
	defer done()
	for _, part := range []struct {
		title, rate, unit string
		forms             []form
	}{{"Acquire + release pairs", "pairs", "pair", pairs}, {"Guarded transactions", "tx", "tx", guards}} {
		fmt.Fprintf(out, "\n#### %s\n\n| form | clients | %s/s | round trips / %s | statements / %s | WAL records / %s | WAL bytes / %s | server CPU µs / %s | client CPU µs / %s |\n|---|---|---|---|---|---|---|---|---|\n",
			part.title, part.rate, part.unit, part.unit, part.unit, part.unit, part.unit, part.unit)
		for _, clients := range []int{1, 8} {
			for _, f := range part.forms {
				c, err := b.costOf(ctx, f, clients, d)
				if err != nil {
					return err
				}
				trips, statements := fmt.Sprintf("%.2f", c.trips), fmt.Sprintf("%.2f", c.statements)
				if strings.HasPrefix(f.name, "Redis") {
					trips, statements = "–", "–"
				}
				server := "–"
				if c.serverKnown {
					server = fmt.Sprintf("%.0f", float64(c.serverCPU.Nanoseconds())/1000)
				}
				fmt.Fprintf(out, "| %s | %d | %.0f | %s | %s | %.2f | %.0f | %s | %.0f |\n", f.name, clients, c.perSecond, trips, statements,
					c.walRecords, c.walBytes, server, float64(c.clientCPU.Nanoseconds())/1000)
			}
		}
	}
	return nil
}
