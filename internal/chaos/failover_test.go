package chaos

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgcluster"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// Tokens across a failover, with a real primary and standby. Tokens are
// epoch << 44 | n and the epoch follows the server's timeline, which every
// promotion and point-in-time recovery moves on, so a promoted standby issues
// tokens above every token the old primary issued, even the ones
// asynchronous replication never delivered. The token sequence WAL-logs 32
// values ahead, so a standby that has the record covering a token would not
// reissue it anyway: the old primary must cross such a boundary while
// replication is cut, hence 40 acquisitions.
//
// async: the old primary stays up after the promotion (split brain at the
// database level) and keeps issuing tokens on its old timeline; a resource
// fence in a third database, written by the new leader, refuses the old
// one. Then the old primary is rewound, rejoins as the new primary's
// standby and is itself promoted: its tokens are above everyone's.
func TestFailoverTokens(t *testing.T) {
	t.Run("async", func(t *testing.T) {
		ctx := pgtest.Context(t, 3*time.Minute)
		// pg_rewind needs hint bits WAL-logged and the WAL since the divergence.
		primary, link, pp, standby, sp := replicated(t, ctx, "wal_log_hints = on", "wal_keep_size = 128MB")
		onPrimary := client(t, pp)
		// The resource: a fence in a third database, on a server of its own.
		_, ledger := migrated(t, ctx, "ledger")
		fenceRes := fence.Resource{Name: "ledger", Schema: "ledger"}
		write := func(tok fence.Token) error {
			return pgx.BeginFunc(ctx, ledger, func(tx pgx.Tx) error { return fenceRes.Admit(ctx, tx, tok) })
		}

		link.Set(faultproxy.Blackhole) // replication is cut
		var (
			oldLeader *lock.Lease
			issued    []fence.Token
		)
		for i := range 40 {
			l, err := onPrimary.TryAcquire(ctx, "failover")
			if err != nil {
				t.Fatalf("acquisition %d on the primary: %v", i, err)
			}
			issued = append(issued, l.Token())
			if i == 39 {
				oldLeader = l // keeps it, and renews it on the old primary
				break
			}
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if err := write(oldLeader.Token()); err != nil {
			t.Fatalf("the old leader's write before the failover: %v", err)
		}

		// The standby is promoted while the old primary goes on.
		promoted := time.Now()
		if err := standby.Promote(); err != nil {
			t.Fatal(err)
		}
		onStandby := client(t, sp)
		newLeader := acquireSoon(t, ctx, onStandby, "failover")
		if tl := timeline(t, sp); tl != 2 || newLeader.Token() < clockFloor(promoted) {
			t.Fatalf("promoted standby: timeline %d, token %d; want timeline 2, a new history from the clock (>= %d)", tl, newLeader.Token(), clockFloor(promoted))
		}
		for _, tok := range issued {
			if newLeader.Token() <= tok {
				t.Fatalf("promoted standby issued %d, not above %d issued by the old primary", newLeader.Token(), tok)
			}
		}
		if err := write(newLeader.Token()); err != nil {
			t.Fatalf("the new leader's write: %v", err)
		}
		// The old primary still accepts writes and its leader still renews.
		if err := oldLeader.Check(ctx); err != nil {
			t.Fatalf("the old leader still holds its lease on the old primary: %v", err)
		}
		if err := write(oldLeader.Token()); !errors.Is(err, fence.ErrFenced) {
			t.Fatalf("resource fence admitted the old leader (token %d) after the new one (%d) wrote: %v", oldLeader.Token(), newLeader.Token(), err)
		}
		// And the old side keeps issuing, on its old timeline: below.
		if err := oldLeader.Release(ctx); err != nil {
			t.Fatal(err)
		}
		again, err := onPrimary.TryAcquire(ctx, "failover")
		if err != nil {
			t.Fatalf("acquire on the old primary after the promotion: %v", err)
		}
		issued = append(issued, again.Token())
		if again.Token() <= oldLeader.Token() || again.Token() >= newLeader.Token() || sameHistory(again.Token(), oldLeader.Token()) != nil {
			t.Fatalf("old primary after the promotion issued %d; want its own history's next, above %d and below the new side's %d", again.Token(), oldLeader.Token(), newLeader.Token())
		}
		if err := write(again.Token()); !errors.Is(err, fence.ErrFenced) {
			t.Fatalf("resource fence admitted token %d of the old primary: %v", again.Token(), err)
		}
		t.Logf("split brain: old primary issued up to %d (epoch 0), promoted standby %d (epoch 1); the fence refused the old side", again.Token(), newLeader.Token())

		// The old primary is rewound and rejoins as the new primary's standby.
		_ = again.Release(ctx)
		// A clean shutdown waits for its walsenders to send everything:
		// drop the cut replication link first.
		link.Set(faultproxy.Reset)
		if err := primary.Stop(); err != nil {
			t.Fatal(err)
		}
		// pg_rewind reads the source's timeline from its control file,
		// which shows the new timeline only after the promotion's first
		// checkpoint (why pgfence reads the timeline elsewhere).
		if _, err := sp.Exec(ctx, "CHECKPOINT"); err != nil {
			t.Fatal(err)
		}
		if err := primary.Rewind(standby.URL()); err != nil {
			t.Fatal(err)
		}
		if err := primary.Follow(standby.Addr()); err != nil {
			t.Fatal(err)
		}
		pp.Reset()
		defer func() {
			if t.Failed() {
				t.Logf("rejoined server's log:\n%s", primary.Log())
			}
		}()
		waitStandby(t, pp, fmt.Sprintf("SELECT count(*) FROM pgfence.pgfence_leases WHERE name = 'failover' AND token = %d", newLeader.Token()))
		// Then the new primary dies and the rejoined one is promoted.
		if err := standby.Crash(); err != nil {
			t.Fatal(err)
		}
		if err := primary.Promote(); err != nil {
			t.Fatal(err)
		}
		rejoined := acquireSoon(t, ctx, client(t, pp), "failover")
		if rejoined.Token() <= newLeader.Token() || sameHistory(rejoined.Token(), newLeader.Token()) == nil {
			t.Fatalf("rejoined and promoted: token %d; want a new history above %d", rejoined.Token(), newLeader.Token())
		}
		if err := write(rejoined.Token()); err != nil {
			t.Fatalf("the third leader's write: %v", err)
		}
		t.Logf("rewound, rejoined and promoted: token %d (timeline %d)", rejoined.Token(), timeline(t, pp))
	})

	// With synchronous replication the acquisition does not return until
	// the standby has it: no client ever holds a token the promoted standby
	// lacks. Its tokens are in the next epoch all the same.
	t.Run("sync", func(t *testing.T) {
		ctx := pgtest.Context(t, 2*time.Minute)
		// Configured from the start: after a reload, pg_stat_replication
		// can say 'sync' before commits wait for the standby.
		primary, link, pp, standby, sp := replicated(t, ctx, "synchronous_standby_names = '*'")
		onPrimary := client(t, pp)
		link.Set(faultproxy.Blackhole)
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		l2, acqErr := onPrimary.TryAcquire(actx, "failover")
		cancel()
		if acqErr == nil {
			t.Fatalf("sync acquisition returned token %d without the standby's acknowledgement", l2.Token())
		}
		if err := primary.Crash(); err != nil {
			t.Fatal(err)
		}
		link.Set(faultproxy.Reset)
		begun := time.Now()
		if err := standby.Promote(); err != nil {
			t.Fatal(err)
		}
		l3 := acquireSoon(t, ctx, client(t, sp), "failover")
		if l3.Token() < clockFloor(begun) {
			t.Fatalf("promoted standby issued %d, want a new history from the clock (>= %d)", l3.Token(), clockFloor(begun))
		}
		t.Logf("sync replication: the acquisition never returned (%v); the promoted standby issued %d", acqErr, l3.Token())
	})

	// A point-in-time recovery of a base backup ends on a new timeline:
	// the restored server's tokens are above everything the original
	// issued after the backup, though it never saw those.
	t.Run("point-in-time-recovery", func(t *testing.T) {
		begun := time.Now()
		ctx := pgtest.Context(t, 2*time.Minute)
		primary, pp := migrated(t, ctx, "pgfence")
		onPrimary := client(t, pp)
		acquireRelease(t, ctx, onPrimary, 3)
		restored, err := pgcluster.NewRestored(primary.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer restored.Close()
		after := acquireRelease(t, ctx, onPrimary, 40) // never in the backup
		rp := connect(t, restored.URL())
		l := acquireSoon(t, ctx, client(t, rp), "failover")
		if l.Token() <= after || l.Token() < clockFloor(begun) {
			t.Fatalf("restored server (timeline %d) issued %d; the original issued up to %d", timeline(t, rp), l.Token(), after)
		}
		t.Logf("point-in-time recovery on timeline %d: token %d above the original's %d", timeline(t, rp), l.Token(), after)
	})

	// A logical dump restored into another cluster starts again at
	// timeline 1. The first client (or migrations.Up) sees the cluster
	// changed and moves the tokens to the epoch after the dump's.
	t.Run("logical-dump", func(t *testing.T) {
		begun := time.Now()
		ctx := pgtest.Context(t, 2*time.Minute)
		source, sp := migrated(t, ctx, "pgfence")
		onSource := client(t, sp)
		acquireRelease(t, ctx, onSource, 3)
		dump, err := source.Output(nil, "pg_dump", "-h", "127.0.0.1", "-p", port(source), "-U", "postgres", "--schema", "pgfence", "postgres")
		if err != nil {
			t.Fatal(err)
		}
		after := acquireRelease(t, ctx, onSource, 5) // not in the dump
		target, err := pgcluster.New()
		if err != nil {
			t.Fatal(err)
		}
		defer target.Close()
		if _, err := target.Output(dump, "psql", "-h", "127.0.0.1", "-p", port(target), "-U", "postgres", "-v", "ON_ERROR_STOP=1", "-q", "postgres"); err != nil {
			t.Fatal(err)
		}
		tp := connect(t, target.URL())
		// No migrations.Up: the client's first acquisition must see it.
		l := acquireSoon(t, ctx, client(t, tp), "failover")
		if l.Token() <= after || l.Token() < clockFloor(begun) {
			t.Fatalf("restored dump issued %d; the source issued up to %d after the dump", l.Token(), after)
		}
		if _, err := migrations.Up(ctx, tp, "pgfence"); err != nil {
			t.Fatal(err)
		}
		l2 := acquireSoon(t, ctx, client(t, tp), "failover-2")
		if err := sameHistory(l2.Token(), l.Token()); err != nil {
			t.Fatalf("after Up: %v (Up must not start another history)", err)
		}
		t.Logf("logical dump into a new cluster: token %d above the source's %d", l.Token(), after)
	})
}

// migrated starts a server with pgfence's migrations in schema and
// returns it and a pool on it.
func migrated(t *testing.T, ctx context.Context, schema string) (*pgcluster.Cluster, *pgxpool.Pool) {
	t.Helper()
	c, err := pgcluster.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	pool := connect(t, c.URL())
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	return c, pool
}

// replicated starts a primary (extraConf appended to its configuration) and
// a streaming standby whose replication goes through a fault proxy, then
// migrates the primary and waits until the standby has one released
// acquisition.
func replicated(t *testing.T, ctx context.Context, extraConf ...string) (*pgcluster.Cluster, *faultproxy.Proxy, *pgxpool.Pool, *pgcluster.Cluster, *pgxpool.Pool) {
	t.Helper()
	primary, err := pgcluster.New(extraConf...)
	pgtest.NeedTool(t, err, pgcluster.ErrNoServer)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = primary.Close() })
	link, err := faultproxy.New(primary.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = link.Close() })
	// The base backup copies the primary's configuration: a promoted
	// standby with synchronous_standby_names set would wait for a standby
	// of its own on every commit.
	standby, err := pgcluster.NewStandby(link.Addr(), "synchronous_standby_names = ''")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = standby.Close() })
	pp := connect(t, primary.URL())
	if _, err := migrations.Up(ctx, pp, "pgfence"); err != nil {
		t.Fatal(err)
	}
	sp := connect(t, standby.URL())
	l1 := acquireRelease(t, ctx, client(t, pp), 1)
	waitStandby(t, sp, fmt.Sprintf("SELECT count(*) FROM pgfence.pgfence_leases WHERE name = 'failover' AND token = %d AND holder IS NULL", l1))
	return primary, link, pp, standby, sp
}

// acquireRelease acquires and releases lease "failover" n times and returns
// the last token.
func acquireRelease(t *testing.T, ctx context.Context, c *lock.Client, n int) fence.Token {
	t.Helper()
	var last fence.Token
	for range n {
		l, err := c.TryAcquire(ctx, "failover")
		if err != nil {
			t.Fatal(err)
		}
		last = l.Token()
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return last
}

// acquireSoon acquires name, retrying while a server finishes its promotion.
func acquireSoon(t *testing.T, ctx context.Context, c *lock.Client, name string) *lock.Lease {
	t.Helper()
	var err error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		var l *lock.Lease
		if l, err = c.TryAcquire(ctx, name); err == nil {
			return l
		}
	}
	t.Fatalf("acquire %s: %v", name, err)
	return nil
}

// timeline is the server's current timeline.
func timeline(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var tl int64
	if err := pool.QueryRow(context.Background(), `SELECT pgfence.pgfence_timeline()`).Scan(&tl); err != nil {
		t.Fatal(err)
	}
	return tl
}

func port(c *pgcluster.Cluster) string {
	_, p, _ := net.SplitHostPort(c.Addr())
	return p
}

func connect(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func client(t *testing.T, pool *pgxpool.Pool) *lock.Client {
	t.Helper()
	c, err := lock.New(pool, lock.Config{Schema: "pgfence", TTL: 5 * time.Second, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = c.Close(ctx)
	})
	return c
}

func waitStandby(t *testing.T, pool *pgxpool.Pool, countSQL string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		var n int
		if err := pool.QueryRow(context.Background(), countSQL).Scan(&n); err == nil && n > 0 {
			return
		}
	}
	t.Fatalf("the standby never replayed: %s", countSQL)
}

// clockFloor is the lowest first token of a history started at or after t
// on a server whose clock is no more than a second behind this machine's:
// milliseconds since 2026-01-01 UTC << 22 (fence.Token).
func clockFloor(t time.Time) fence.Token {
	ms := t.Add(-time.Second).Sub(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)).Milliseconds()
	return fence.Token(ms << 22)
}

// sameHistory returns an error unless later was issued after earlier in the
// same history (counted on by one, not started again at the clock).
func sameHistory(later, earlier fence.Token) error {
	if later <= earlier || later-earlier >= 1<<20 {
		return fmt.Errorf("token %d is not in the history of %d", later, earlier)
	}
	return nil
}
