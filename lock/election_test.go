package lock_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// Two clients campaign; the leader's lease is expired at the database; the
// other takes over with a greater token; OnStop runs after every term with
// the reason; Run returns when its context ends.
func TestElectionFailover(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	type term struct {
		who   string
		token fence.Token
	}
	var (
		mu      sync.Mutex
		terms   []term
		stops   []error
		started = make(chan struct{}, 10)
	)
	run := func(who string) *lock.Election {
		c := newClient(t, db, lock.Config{Holder: who, TTL: 1200 * time.Millisecond, RenewInterval: 100 * time.Millisecond,
			PollInterval: 50 * time.Millisecond})
		return &lock.Election{Client: c, Name: "leader", RetryDelay: 300 * time.Millisecond,
			Lead: func(ctx context.Context, l *lock.Lease) error {
				mu.Lock()
				terms = append(terms, term{who, l.Token()})
				mu.Unlock()
				started <- struct{}{}
				<-ctx.Done()
				return nil
			},
			OnStop: func(l *lock.Lease, err error) {
				mu.Lock()
				stops = append(stops, err)
				mu.Unlock()
			}}
	}
	var wg sync.WaitGroup
	for _, who := range []string{"a", "b"} {
		e := run(who)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := e.Run(ctx); err != nil {
				t.Errorf("Run(%s): %v", who, err)
			}
		}()
	}
	<-started
	expire(t, db, "leader") // the database now says the leader's lease is over
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("no takeover after the leader's lease expired")
	}
	// The old leader notices at its next renewal.
	pgtest.Eventually(t, 5*time.Second, "the old leader's term to end", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(stops) > 0
	})
	cancel()
	wg.Wait()

	mu.Lock()
	defer mu.Unlock()
	if len(terms) < 2 || terms[1].token <= terms[0].token {
		t.Fatalf("terms = %+v, want a second term with a greater token", terms)
	}
	if len(stops) != len(terms) {
		t.Fatalf("%d terms but OnStop ran %d times", len(terms), len(stops))
	}
	if !errors.Is(stops[0], lock.ErrLeaseLost) {
		t.Fatalf("first term ended with %v, want ErrLeaseLost", stops[0])
	}
}
