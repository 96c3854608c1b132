package lock_test

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// The epoch switch under load. The shared test server cannot be promoted,
// so the test moves what the epoch is computed from: the timeline (its
// function is replaced) while 16 goroutines acquire and release, then the
// recorded cluster (as a logical restore into another cluster would) for a
// client that starts afterwards. internal/chaos TestFailoverTokens does it
// with real promotions. Every token must be issued once, rise per lease,
// and every acquisition that began after a switch must be in the new epoch.
func TestEpochSwitchesUnderLoad(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	epoch := ident.Table(db.Schema, "pgfence_epoch")
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
	// A new timeline: the server's timeline function now says one more.
	var tl int64
	if err := db.Pool.QueryRow(ctx, "SELECT "+ident.Table(db.Schema, "pgfence_timeline")+"()").Scan(&tl); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, fmt.Sprintf("CREATE OR REPLACE FUNCTION %s() RETURNS bigint LANGUAGE sql VOLATILE AS 'SELECT %d::bigint'",
		ident.Table(db.Schema, "pgfence_timeline"), tl+1)); err != nil {
		t.Fatal(err)
	}
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
	for _, tok := range after {
		if tok.Epoch() != 1 {
			t.Fatalf("token %d (epoch %d) acquired after the switch to epoch 1", tok, tok.Epoch())
		}
	}
	var e, row int64
	if err := db.Pool.QueryRow(ctx, "SELECT epoch FROM "+epoch).Scan(&e); err != nil {
		t.Fatal(err)
	}
	if e != 1 || all[len(all)-1].Epoch() != 1 {
		t.Fatalf("epoch row %d, newest token %d; want both in epoch 1", e, all[len(all)-1])
	}

	// Another cluster: the row names a system identifier this server does
	// not have. A client's first acquisition moves to the next epoch.
	if _, err := db.Pool.Exec(ctx, "UPDATE "+epoch+" SET system_identifier = system_identifier + 1"); err != nil {
		t.Fatal(err)
	}
	fresh := newClient(t, db, lock.Config{TTL: 10 * time.Second})
	l, err := fresh.TryAcquire(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if l.Token().Epoch() != 2 {
		t.Fatalf("after the cluster changed: token %d in epoch %d, want 2", l.Token(), l.Token().Epoch())
	}
	_ = l.Release(ctx)
	// And once synced, a new client does not move it again.
	again, err := newClient(t, db, lock.Config{TTL: 10 * time.Second}).TryAcquire(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, "SELECT epoch FROM "+epoch).Scan(&row); err != nil {
		t.Fatal(err)
	}
	if again.Token().Epoch() != 2 || row != 2 {
		t.Fatalf("a second client moved the epoch: token %d, row %d", again.Token(), row)
	}
	_ = again.Release(ctx)
}
