package lock_test

import (
	"context"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// An observer that never campaigns learns of each new holder of a lease, of
// a release and of a takeover after an expiry, each within far less than
// its poll interval (30s here): by notification. Its channel closes when
// its context ends.
func TestObserveSeesEachNewHolder(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	observer := newClient(t, db, lock.Config{PollInterval: 30 * time.Second})
	holders := map[string]*lock.Client{}
	for _, h := range []string{"b", "c", "d"} {
		holders[h] = newClient(t, db, lock.Config{Holder: h})
	}
	// Observing a name never acquired reads as free.
	octx, stop := context.WithCancel(ctx)
	never, err := observer.Observe(octx, "never")
	if err != nil {
		t.Fatal(err)
	}
	if i := <-never; i.Name != "never" || i.Held || i.Token != 0 {
		t.Fatalf("a name never acquired: %+v", i)
	}
	l, err := holders["b"].TryAcquire(ctx, "watched")
	if err != nil {
		t.Fatal(err)
	}
	seen, err := observer.Observe(octx, "watched")
	if err != nil {
		t.Fatal(err)
	}
	next := func(what string) lock.Info {
		t.Helper()
		select {
		case i, ok := <-seen:
			if !ok {
				t.Fatalf("%s: the channel closed", what)
			}
			return i
		case <-time.After(5 * time.Second): // the poll interval is 30s
			t.Fatalf("%s: no news within 5s", what)
		}
		return lock.Info{}
	}
	if i := next("the first state"); !i.Held || i.Holder != "b" || i.Token != l.Token() {
		t.Fatalf("first state: %+v, want b with token %d", i, l.Token())
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if i := next("the release"); i.Held {
		t.Fatalf("after the release: %+v", i)
	}
	lc, err := holders["c"].TryAcquire(ctx, "watched")
	if err != nil {
		t.Fatal(err)
	}
	if i := next("c's acquisition"); !i.Held || i.Holder != "c" || i.Token != lc.Token() {
		t.Fatalf("after c acquired: %+v, want c with token %d", i, lc.Token())
	}
	// c's lease ends at the database (c frozen past its TTL) and d takes
	// it over: no release is announced, the acquisition is.
	if _, err := db.Pool.Exec(ctx, expiry.SQL(db.Schema), "watched"); err != nil {
		t.Fatal(err)
	}
	ld, err := holders["d"].TryAcquire(ctx, "watched")
	if err != nil {
		t.Fatal(err)
	}
	for {
		i := next("d's takeover")
		if i.Holder == "d" {
			if !i.Held || i.Token != ld.Token() {
				t.Fatalf("after d took over: %+v, want held with token %d", i, ld.Token())
			}
			break
		}
		if i.Holder != "c" {
			t.Fatalf("between c and d: %+v", i)
		}
	}
	stop()
	for range seen { // drained, then closed
	}
	if _, ok := <-never; ok {
		t.Fatal("the other observation's channel stayed open after its context ended")
	}
	if _, err := observer.Observe(ctx, ""); err == nil {
		t.Fatal("Observe of an empty name: no error")
	}
}
