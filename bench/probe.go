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
// report their statistics, and waits for them to be gone (from /proc as
// well, when the server runs here). Connections a lease client has taken
// out of the pool for itself stay.
func (b *bench) flushed(ctx context.Context) error {
	_, local := serverCPU()
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
		if err != nil {
			return err
		}
		for _, pid := range pids {
			if !local {
				break
			}
			// Gone from /proc too (reaped), so that its CPU time has
			// moved to the postmaster's before serverCPU reads it.
			if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
				n++
			}
		}
		if n == 0 {
			return nil
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
		d.String()+" each, with what it cost per op: round trips and statements the client sent (a pgx tracer; Redis and etcd: –, and so are their WAL and server CPU), "+
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
				records, bytes := fmt.Sprintf("%.2f", c.walRecords), fmt.Sprintf("%.0f", c.walBytes)
				server := "–"
				if c.serverKnown {
					server = fmt.Sprintf("%.0f", float64(c.serverCPU.Nanoseconds())/1000)
				}
				if strings.HasPrefix(f.name, "Redis") || f.name == etcdForm {
					// Not PostgreSQL: its client, WAL and server are not the ones measured.
					trips, statements, records, bytes, server = "–", "–", "–", "–", "–"
				}
				fmt.Fprintf(out, "| %s | %d | %.0f | %s | %s | %s | %s | %s | %.0f |\n", f.name, clients, c.perSecond, trips, statements,
					records, bytes, server, float64(c.clientCPU.Nanoseconds())/1000)
			}
		}
	}
	return nil
}

// parts measures what each part of the acquisition statement costs: the
// statement as lock/sql.go has it, the statement before sessions (the lease
// row alone, on a table of that layout), then that one with one part taken
// out at a time, each paired with the default (asynchronous) release,
// against the floor of an asynchronous commit. The statements mirror
// lock's; the parts taken out are what the fencing guarantees rest on, so
// this is an account of the gap, not a list of options.
func (b *bench) parts(ctx context.Context, out *bytes.Buffer, rounds int, d time.Duration) error {
	t, st, old := schema+".pgfence_leases", schema+".pgfence_sessions", schema+".leases_before_sessions"
	var session int64
	if err := b.pool.QueryRow(ctx, "INSERT INTO "+st+" (holder, started_at, renewed_at, expires_at) "+
		"VALUES ('bench-parts', now(), now(), now() + interval '1 day') RETURNING id").Scan(&session); err != nil {
		return err
	}
	if _, err := b.pool.Exec(ctx, "INSERT INTO "+t+" (name, acquired_at) "+
		"SELECT 'parts-' || g, now() FROM generate_series(0, 7) g ON CONFLICT DO NOTHING"); err != nil {
		return err
	}
	if _, err := b.pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+old+` (
    name text PRIMARY KEY, token bigint GENERATED ALWAYS AS IDENTITY (CACHE 1), holder text, secret bytea,
    acquired_at timestamptz NOT NULL, renewed_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
    waiters_until timestamptz, observers_until timestamptz) WITH (fillfactor = 10);
INSERT INTO `+old+` (name, acquired_at, renewed_at, expires_at)
SELECT 'parts-' || g, now(), now(), now() FROM generate_series(0, 7) g ON CONFLICT DO NOTHING`); err != nil {
		return err
	}
	epoch := fmt.Sprintf("(%[1]s.pgfence_timeline() = %[1]s.pgfence_epoch_timeline() OR %[1]s.pgfence_sync_epoch())", schema)
	wake := "CASE WHEN l.waiters_until > now() THEN " + schema + ".pgfence_wake_waiters(l.name) ELSE false END"
	// Today's statements, as lock/sql.go builds them.
	acquire := `WITH locked AS (
  SELECT f.name, f.session FROM ` + t + ` f
   WHERE f.name = $1 AND (f.session IS NULL OR EXISTS (SELECT FROM ` + st + ` s WHERE s.id = f.session AND s.expires_at <= now()))
   FOR UPDATE),
taken AS (UPDATE ` + st + ` s SET losses = s.losses + 1 FROM locked WHERE s.id = locked.session AND s.expires_at <= now() RETURNING s.id)
UPDATE ` + t + ` l SET token = DEFAULT, holder = $2, secret = $3, session = $4, acquired_at = clock_timestamp(), freed_at = NULL
  FROM locked
 WHERE l.name = locked.name AND (locked.session IS NULL OR EXISTS (SELECT FROM taken)) AND ` + epoch + `
RETURNING l.token`
	release := "UPDATE " + t + " l SET holder = NULL, secret = NULL, session = NULL, freed_at = now() WHERE l.name = $1 AND l.token = $2 AND l.secret = $3 " +
		"RETURNING " + wake + ", set_config('synchronous_commit', 'off', true)"
	// The statements before sessions: the lease row carried its own expiry.
	const set = "SET token = DEFAULT, holder = $2, secret = $3, acquired_at = clock_timestamp(), renewed_at = clock_timestamp(), " +
		"expires_at = clock_timestamp() + 15000000 * interval '1 microsecond'"
	free := "(l.holder IS NULL OR l.expires_at <= now())"
	lockRow := "l.name = (SELECT f.name FROM " + old + " f WHERE f.name = $1 AND (f.holder IS NULL OR f.expires_at <= now()) FOR UPDATE)"
	releaseOld := "UPDATE " + old + " l SET holder = NULL, secret = NULL, expires_at = least(l.expires_at, now()) WHERE l.name = $1 AND l.token = $2 AND l.secret = $3 " +
		"RETURNING " + wake + ", set_config('synchronous_commit', 'off', true)"
	pair := func(acquire, release string, withSession bool) func(context.Context, int, bool) (op, func(), error) {
		return func(_ context.Context, client int, _ bool) (op, func(), error) {
			name, secret := fmt.Sprintf("parts-%d", client), []byte{byte(client)}
			args := []any{name, "bench-parts", secret}
			if withSession {
				args = append(args, session)
			}
			return func(ctx context.Context) (bool, error) {
				var token int64
				if err := b.pool.QueryRow(ctx, acquire, args...).Scan(&token); err != nil {
					return false, fmt.Errorf("acquire: %w", err)
				}
				_, err := b.pool.Exec(ctx, release, name, token, secret)
				return err == nil, err
			}, func() {}, nil
		}
	}
	upd := "UPDATE " + old + " l "
	forms := []form{
		{floorAsync, "acquire only", func(_ context.Context, client int, _ bool) (op, func(), error) {
			st := "UPDATE " + schema + ".floor SET v = v + 1 WHERE id = $1"
			return func(ctx context.Context) (bool, error) {
				if _, err := b.pool.Exec(ctx, st, client+1); err != nil {
					return false, err
				}
				_, err := b.pool.Exec(ctx, st+" RETURNING set_config('synchronous_commit', 'off', true)", client+1)
				return err == nil, err
			}, func() {}, nil
		}},
		{"the acquisition as pgfence sends it (the session's liveness)", "acquire only", pair(acquire, release, true)},
		{"the acquisition before sessions (the lease row's own expiry)", "acquire only", pair(upd+set+" WHERE "+lockRow+" AND "+free+" AND "+epoch+" RETURNING l.token", releaseOld, false)},
		{"... without the explicit row lock (FOR UPDATE)", "acquire only", pair(upd+set+" WHERE l.name = $1 AND "+free+" AND "+epoch+" RETURNING l.token", releaseOld, false)},
		{"... and without the epoch check", "acquire only", pair(upd+set+" WHERE l.name = $1 AND "+free+" RETURNING l.token", releaseOld, false)},
		{"... and without a new token (no sequence)", "acquire only", pair(upd+strings.Replace(set, "token = DEFAULT, ", "", 1)+
			" WHERE l.name = $1 AND "+free+" RETURNING l.token", releaseOld, false)},
	}
	fmt.Fprint(out, "\n### What the acquisition's parts cost\n\nThe acquisition statement as `lock` sends it, then with its parts "+
		"taken out one after another (cumulatively), each followed by the default release, against the like-for-like floor; "+
		"raw statements, no lock client. The second row is the statement before sessions, on a table of that layout (each "+
		"lease row carried its own expiry, and every renewal rewrote it). What is taken out is what the guarantees rest on: "+
		"the explicit row lock makes a takeover wait for guarded transactions, the epoch check keeps tokens rising across a "+
		"failover, the sequence issues the token. What remains after the last row is the lease row's own bookkeeping.\n")
	return table(ctx, out, "pairs/s", forms, []string{"distinct names"}, []int{8}, rounds, d, func(f form) string {
		if f.name == floorAsync {
			return ""
		}
		return floorAsync
	})
}
