package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// The wire-fault run: guarded transactions of every kind (Guard.RunTx,
// Lease.RunTx, Resource.RunTx) through a proxy that, at a share of the
// COMMITs, resets the connection right after forwarding it, after the
// server's reply, before forwarding it, forwards it late, holds the reply
// past the caller's deadline, or cuts the connection without a word;
// meanwhile backends are terminated at random points and leases are taken
// over under their holders. Each transaction inserts one row with an id of
// its own, and afterwards every answer is compared with the table.

// wireRun is one run's shape.
type wireRun struct {
	workers, each int
	faultShare    float64 // of COMMITs that meet a fault
	naive         bool    // commit by hand and take any error for "not committed"
}

// wireTally is what the checker found.
type wireTally struct {
	total, committed, notCommitted, fenced, unknown, failed int
	mismatches                                              []string
	examples                                                map[string]string // an error text for each kind of answer
	faults                                                  map[faultproxy.CommitFault]int
	kills, takeovers                                        int
}

func (w wireTally) String() string {
	var f []string
	for _, k := range []faultproxy.CommitFault{faultproxy.ResetAfterCommit, faultproxy.ResetAfterReply,
		faultproxy.ResetBeforeCommit, faultproxy.LateCommit, faultproxy.HoldReply, faultproxy.HalfOpen} {
		f = append(f, fmt.Sprintf("%v=%d", k, w.faults[k]))
	}
	return fmt.Sprintf("transactions=%d committed=%d not_committed=%d fenced=%d failed=%d unknown=%d mismatches=%d | "+
		"faults: %s kills=%d takeovers=%d", w.total, w.committed, w.notCommitted, w.fenced, w.failed, w.unknown,
		len(w.mismatches), strings.Join(f, " "), w.kills, w.takeovers)
}

// wireDeadline is each transaction's deadline: a held reply or a
// half-open connection ends there.
const wireDeadline = time.Second

func runWire(t *testing.T, db *pgtest.DB, run wireRun) wireTally {
	t.Helper()
	defer func(start time.Time) {
		t.Logf("%d workers x %d transactions in %v", run.workers, run.each, time.Since(start))
	}(time.Now())
	ctx := pgtest.Context(t, 5*time.Minute)
	link, err := faultproxy.To(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	app := pgtest.UniqueName("wire")
	pool := pgtest.NewPool(t, app, func(cfg *pgxpool.Config) {
		link.Route(&cfg.ConnConfig.Config)
		// Connections whose reply is held keep their slot while pgx
		// closes them (up to 15 s): room for them.
		cfg.MaxConns = 64
	})
	t.Cleanup(func() { _ = link.Close() }) // first: it lets pgx close held connections
	tbl := pgx.Identifier{db.Schema, "wire_" + strconv.FormatBool(run.naive)}.Sanitize()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+tbl+" (id text PRIMARY KEY, token bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, TTL: 10 * time.Second, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	usurper := db.Client(t, lock.Config{Schema: db.Schema, TTL: 10 * time.Second})

	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(seed(t), 31))
	tally := wireTally{faults: map[faultproxy.CommitFault]int{}, examples: map[string]string{}}
	kinds := []faultproxy.CommitFault{faultproxy.ResetAfterCommit, faultproxy.ResetAfterReply, faultproxy.ResetBeforeCommit,
		faultproxy.LateCommit, faultproxy.HoldReply, faultproxy.HalfOpen}
	link.OnCommit(func() (faultproxy.CommitFault, time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		if rng.Float64() >= run.faultShare {
			return faultproxy.CommitPass, 0
		}
		return kinds[rng.IntN(len(kinds))], time.Duration(50+rng.IntN(350)) * time.Millisecond
	})

	// The killer terminates a random backend of the workers' pool now and
	// then: between statements, during one, during COMMIT.
	kctx, stopKiller := context.WithCancel(ctx)
	killed := make(chan int)
	go func() {
		n := 0
		defer func() { killed <- n }()
		for {
			mu.Lock()
			d := time.Duration(30+rng.IntN(120)) * time.Millisecond
			mu.Unlock()
			select {
			case <-kctx.Done():
				return
			case <-time.After(d):
			}
			var k int
			if err := db.Pool.QueryRow(kctx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name = $1 AND state <> 'idle' ORDER BY random() LIMIT 1) k`, app).Scan(&k); err == nil {
				n += k
			}
		}
	}()

	type answer struct {
		id  string
		err error
	}
	answers := make([][]answer, run.workers)
	var wg sync.WaitGroup
	for w := range run.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("wire-%v-%d", run.naive, w)
			res := fence.Resource{Name: name, Schema: db.Schema}
			var l *lock.Lease
			for i := range run.each {
				for l == nil || l.Err() != nil {
					// (Re)acquire, after a takeover or a lost lease.
					// Bounded: the acquisition's own statements meet the
					// faults too, and a half-open connection never answers.
					actx, cancel := context.WithTimeout(ctx, 10*time.Second)
					l, _ = c.Acquire(actx, name)
					cancel()
					if ctx.Err() != nil {
						return
					}
				}
				g := l.Guard()
				mu.Lock()
				takeover := rng.IntN(40) == 0
				kind := rng.IntN(3)
				mu.Unlock()
				if takeover {
					moved, err := takeOver(ctx, db, usurper, name)
					if err != nil {
						t.Error(err)
						return
					}
					mu.Lock()
					tally.takeovers += moved
					mu.Unlock()
				}
				id := fmt.Sprintf("w%d-%d", w, i)
				tctx, cancel := context.WithTimeout(ctx, wireDeadline)
				insert := func(tx pgx.Tx) error {
					_, err := tx.Exec(tctx, "INSERT INTO "+tbl+" VALUES ($1, $2)", id, int64(g.Token))
					return err
				}
				var err error
				switch {
				case run.naive:
					err = naiveTx(tctx, pool, insert)
				case kind == 0:
					err = g.RunTx(tctx, pool, insert)
				case kind == 1:
					err = l.RunTx(tctx, insert)
				default:
					err = res.RunTx(tctx, pool, g.Token, insert)
				}
				cancel()
				answers[w] = append(answers[w], answer{id, err})
				if errors.Is(err, fence.ErrStaleToken) {
					rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
					_ = l.Release(rctx) // ended: a greater token was issued
					cancel()
					l = nil
				}
				if ctx.Err() != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	stopKiller()
	tally.kills = <-killed
	tally.faults = link.Commits()

	present := map[string]bool{}
	rows, err := db.Pool.Query(ctx, "SELECT id FROM "+tbl)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		present[id] = true
	}
	for _, as := range answers {
		for _, a := range as {
			tally.total++
			switch {
			case a.err == nil:
				tally.committed++
				if !present[a.id] {
					tally.mismatches = append(tally.mismatches, fmt.Sprintf("%s: answered committed, no row", a.id))
				}
				continue
			case errors.Is(a.err, fence.ErrOutcomeUnknown):
				tally.unknown++
				tally.examples["unknown"] = a.err.Error()
				continue // either is true
			case errors.Is(a.err, fence.ErrFenced):
				tally.fenced++
			case errors.Is(a.err, fence.ErrNotCommitted):
				tally.notCommitted++
				tally.examples["not committed"] = a.err.Error()
			default:
				tally.failed++
				tally.examples["failed"] = a.err.Error()
			}
			if present[a.id] {
				tally.mismatches = append(tally.mismatches, fmt.Sprintf("%s: answered %v (retryable %v), but committed",
					a.id, a.err, fence.Retryable(a.err)))
			}
		}
	}
	return tally
}

// takeOver moves the lease under its holder: it expires it at the
// database, has usurper acquire it (raising the token) and release it, and
// returns 1; the holder's next write with its old guard is refused. It
// returns 0 when a renewal got in first.
func takeOver(ctx context.Context, db *pgtest.DB, usurper *lock.Client, name string) (int, error) {
	if _, err := db.Pool.Exec(ctx, expiry.SQL(db.Schema), name); err != nil {
		return 0, err
	}
	ul, err := usurper.TryAcquire(ctx, name)
	switch {
	case errors.Is(err, lock.ErrHeld):
		return 0, nil
	case err != nil:
		return 0, err
	}
	return 1, ul.Release(ctx)
}

// naiveTx is how a caller who trusts a COMMIT error commits: any error
// means "not committed".
func naiveTx(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) error) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// seed is the run's seed: CHAOS_SEED, or a fresh one (logged).
func seed(t *testing.T) uint64 {
	if s, err := strconv.ParseUint(os.Getenv("CHAOS_SEED"), 10, 64); err == nil {
		return s
	}
	s := rand.Uint64()
	t.Logf("wire faults: seed %d (CHAOS_SEED=%d replays the fault choices)", s, s)
	return s
}

// Thousands of guarded transactions under wire faults at COMMIT,
// terminated backends and takeovers: every answer is true (nil exactly when
// the row is there; ErrNotCommitted, a refusal or any other error exactly
// when it is not), ErrOutcomeUnknown is counted, no id is inserted twice
// (the primary key would turn a second insert into an error whose row is
// present: a mismatch). The negative control, a client that takes a COMMIT
// error for "not committed", is caught by the same checker.
func TestWireFaults(t *testing.T) {
	db := pgtest.New(t)
	each := 250
	if testing.Short() {
		each = 60
	}
	got := runWire(t, db, wireRun{workers: 8, each: each, faultShare: 0.25})
	t.Logf("guarded: %v", got)
	for kind, e := range got.examples {
		t.Logf("e.g. %s: %s", kind, e)
	}
	for _, m := range got.mismatches {
		t.Error(m)
	}
	if got.total < 8*each {
		t.Errorf("%d transactions ran, want %d", got.total, 8*each)
	}
	for k, n := range got.faults {
		if k != faultproxy.CommitPass && n == 0 {
			t.Errorf("no COMMIT met %v: the run did not exercise it", k)
		}
	}
	if got.fenced == 0 || got.kills == 0 {
		t.Errorf("no refusal (%d) or no terminated backend (%d): the run did not exercise them", got.fenced, got.kills)
	}

	control := runWire(t, db, wireRun{workers: 4, each: 60, faultShare: 0.25, naive: true})
	t.Logf("control (naive commits): %v", control)
	if len(control.mismatches) == 0 {
		t.Errorf("the checker caught no false answer of a client that takes a COMMIT error for \"not committed\"")
	} else {
		t.Logf("control caught: %s", control.mismatches[0])
	}
}
