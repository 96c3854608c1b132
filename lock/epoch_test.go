package lock_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// The epoch switch under load. The shared test server cannot be promoted,
// so the test moves what a new history is detected from: the timeline (its
// function is replaced) while 16 goroutines acquire and release, then the
// recorded cluster (as a logical restore into another cluster would) for a
// client that starts afterwards. internal/chaos TestFailoverTokens and
// TestPatroniFailovers do it with real promotions. Every token must be
// issued once and rise per lease; every acquisition that began after a
// switch must be in the new history, which starts at the server's clock.
func TestEpochSwitchesUnderLoad(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	const workers = 16
	var (
		mu       sync.Mutex
		all      []fence.Token
		switched = make(chan struct{})
		after    []fence.Token // acquisitions sent after the switch
		wg       sync.WaitGroup
	)
	c := newClient(t, db, lock.Config{TTL: 10 * time.Second})
	// The client's first acquisition syncs the epoch once (for a cluster
	// change); do it now, so that only the acquisitions' own check can
	// notice the switch below.
	if l, err := c.TryAcquire(ctx, "first"); err != nil {
		t.Fatal(err)
	} else if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := []string{"a", "b", "c", "d"}[w%4]
			var last fence.Token
			for i := 0; i < 60; i++ {
				begun := false
				select {
				case <-switched:
					begun = true
				default:
				}
				l, err := c.Acquire(ctx, name)
				if err != nil {
					t.Error(err)
					return
				}
				if l.Token() <= last {
					t.Errorf("lease %s: token %d after %d", name, l.Token(), last)
				}
				last = l.Token()
				mu.Lock()
				all = append(all, l.Token())
				if begun {
					after = append(after, l.Token())
				}
				mu.Unlock()
				if err := l.Release(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	time.Sleep(100 * time.Millisecond)
	clock := clockToken(t, db)
	newTimeline(t, db, 1)
	close(switched)
	wg.Wait()
	if t.Failed() {
		return
	}
	slices.Sort(all)
	for i := 1; i < len(all); i++ {
		if all[i] == all[i-1] {
			t.Fatalf("token %d issued twice", all[i])
		}
	}
	if len(after) == 0 {
		t.Fatal("no acquisition began after the switch; the test proved nothing")
	}
	first := firstToken(t, db)
	if first < clock {
		t.Fatalf("the new history starts at %d, below the server's clock before the switch (%d)", first, clock)
	}
	for _, tok := range after {
		if tok < first {
			t.Fatalf("token %d acquired after the switch, below the new history's first token %d", tok, first)
		}
	}

	// Another cluster: the row names a system identifier this server does
	// not have. A client's first acquisition starts a new history.
	if _, err := db.Pool.Exec(ctx, "UPDATE "+ident.Table(db.Schema, "pgfence_epoch")+" SET system_identifier = system_identifier + 1"); err != nil {
		t.Fatal(err)
	}
	fresh := newClient(t, db, lock.Config{TTL: 10 * time.Second})
	l, err := fresh.TryAcquire(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if f := firstToken(t, db); l.Token() != f || f <= all[len(all)-1] {
		t.Fatalf("after the cluster changed: token %d, history from %d; want the history's first, above %d", l.Token(), f, all[len(all)-1])
	}
	_ = l.Release(ctx)
	// And once synced, a new client does not start another.
	again, err := newClient(t, db, lock.Config{TTL: 10 * time.Second}).TryAcquire(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if f := firstToken(t, db); again.Token() != l.Token()+1 || f != l.Token() {
		t.Fatalf("a second client moved the history: token %d after %d, history from %d", again.Token(), l.Token(), f)
	}
	_ = again.Release(ctx)
}

// Two histories that both call themselves timeline N: history B is
// promoted from timeline N-1 and issues tokens; then a server that never
// received B's WAL (its data is as it was before B) is promoted to the same
// timeline ID, as a Patroni replica does that did not follow B before B
// crashed. Its tokens must be above B's. The shared server stands in for
// both: B's state is rolled back by hand (sequence, epoch row and baked
// timeline as they were), keeping the new timeline.
func TestTokensRiseAcrossHistoriesWithOneTimelineID(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c := newClient(t, db, lock.Config{TTL: 10 * time.Second})
	churn := func(n int) (out []fence.Token) {
		for range n {
			l, err := c.TryAcquire(ctx, "reused")
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, l.Token())
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		return out
	}
	churn(3)
	// The state a replica of the old primary has.
	epoch := ident.Table(db.Schema, "pgfence_epoch")
	var (
		row, fn string
		seq     int64
	)
	if err := db.Pool.QueryRow(ctx, "SELECT to_jsonb(e)::text FROM "+epoch+" e").Scan(&row); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, "SELECT pg_get_functiondef($1::regprocedure)", ident.Table(db.Schema, "pgfence_epoch_timeline")+"()").Scan(&fn); err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, "SELECT last_value FROM "+ident.Table(db.Schema, "pgfence_leases_token_seq")).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	// History B.
	newTimeline(t, db, 1)
	onB := churn(5)
	// History C: the same timeline ID, B's WAL never received.
	if _, err := db.Pool.Exec(ctx, "SELECT setval($1::regclass, $2)", ident.Table(db.Schema, "pgfence_leases_token_seq"), seq); err != nil {
		t.Fatal(err)
	}
	cols := epochColumns(t, db)
	if _, err := db.Pool.Exec(ctx, "UPDATE "+epoch+" SET ("+cols+") = (SELECT "+cols+" FROM jsonb_populate_record(NULL::"+epoch+", $1::jsonb))", row); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, fn); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Millisecond) // C is promoted after B issued its last token
	onC := churn(5)
	for _, b := range onB {
		for _, cTok := range onC {
			if cTok <= b {
				t.Fatalf("history C issued %d, not above %d issued by history B on the same timeline ID (B %v, C %v)", cTok, b, onB, onC)
			}
		}
	}
}

// A server whose clock is behind the tokens it knows of refuses to start a
// new history (PF013, which Acquire retries) instead of issuing tokens that
// a lost history may already have issued.
func TestNewHistoryRefusedWhileTheClockIsBehind(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c := newClient(t, db, lock.Config{TTL: 10 * time.Second})
	l, err := c.TryAcquire(ctx, "clock")
	if err != nil {
		t.Fatal(err)
	}
	_ = l.Release(ctx)
	// Tokens from an hour ahead of this server's clock.
	ahead := clockToken(t, db) + fence.Token(3600*1000)<<22
	if _, err := db.Pool.Exec(ctx, "SELECT setval($1::regclass, $2)", ident.Table(db.Schema, "pgfence_leases_token_seq"), int64(ahead)); err != nil {
		t.Fatal(err)
	}
	newTimeline(t, db, 1)
	_, err = c.TryAcquire(ctx, "clock")
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || pg.Code != "PF013" {
		t.Fatalf("acquire on a server whose clock is behind the tokens: %v, want PF013", err)
	}
	if first := firstToken(t, db); first >= ahead {
		t.Fatalf("a history started at %d despite the clock", first)
	}
}

// newTimeline makes the schema's timeline function report d more than the
// server's timeline, as a promotion would.
func newTimeline(t *testing.T, db *pgtest.DB, d int64) {
	t.Helper()
	var tl int64
	if err := db.Pool.QueryRow(context.Background(), "SELECT "+ident.Table(db.Schema, "pgfence_timeline")+"()").Scan(&tl); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(context.Background(), fmt.Sprintf("CREATE OR REPLACE FUNCTION %s() RETURNS bigint LANGUAGE sql VOLATILE AS 'SELECT %d::bigint'",
		ident.Table(db.Schema, "pgfence_timeline"), tl+d)); err != nil {
		t.Fatal(err)
	}
}

// clockToken is the first token a history started now would issue.
func clockToken(t *testing.T, db *pgtest.DB) fence.Token {
	t.Helper()
	var v int64
	if err := db.Pool.QueryRow(context.Background(),
		`SELECT floor(extract(epoch FROM clock_timestamp() - timestamptz '2026-01-01 00:00:00+00') * 1000)::bigint << 22`).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return fence.Token(v)
}

// firstToken is the current history's first token.
func firstToken(t *testing.T, db *pgtest.DB) fence.Token {
	t.Helper()
	var v int64
	if err := db.Pool.QueryRow(context.Background(), "SELECT first_token FROM "+ident.Table(db.Schema, "pgfence_epoch")).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return fence.Token(v)
}

// epochColumns lists the epoch row's columns.
func epochColumns(t *testing.T, db *pgtest.DB) string {
	t.Helper()
	var cols string
	if err := db.Pool.QueryRow(context.Background(), `SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute
  WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped`, ident.Table(db.Schema, "pgfence_epoch")).Scan(&cols); err != nil {
		t.Fatal(err)
	}
	return cols
}
