package notify

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/retry"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// woken waits for s to be woken, for as long as a loaded machine may need.
func woken(t *testing.T, s *Sub, what string) {
	t.Helper()
	select {
	case <-s.C:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: not woken within 30 s", what)
	}
}

// notWoken fails if s has a wake pending.
func notWoken(t *testing.T, s *Sub, what string) {
	t.Helper()
	select {
	case <-s.C:
		t.Fatalf("%s: woken", what)
	default:
	}
}

// The poller covers only the subscriptions that ask it to, in one call
// per round for all their keys; it wakes each after its first round, and
// then those whose key the round found ready. Close wakes the ones it
// covers and refuses new ones. No database: the listener's connects are
// refused, and only the poller wakes.
func TestPollerWakesNewAndReadySubscriptions(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	g := bg.New(context.Background())
	defer g.Stop()
	var (
		mu     sync.Mutex
		ready  = map[string]bool{}
		rounds = make(chan []string, 16)
	)
	h := New(g, pool, Config{
		Schema: "pgfence",
		Bound:  time.Second, Linger: 0, MaxBackoff: time.Second,
		Poll: func(_ context.Context, keys []string) ([]string, time.Duration, error) {
			slices.Sort(keys)
			rounds <- keys
			mu.Lock()
			defer mu.Unlock()
			var r []string
			for _, k := range keys {
				if ready[k] {
					r = append(r, k)
				}
			}
			return r, time.Hour, nil // the next round when a subscription asks
		},
		Backoff: retry.Backoff{Base: time.Millisecond, Max: time.Millisecond},
		Log:     slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	// round waits for a round that polls want (a kick that came during a
	// round brings one more of the same), and returns those before it.
	round := func(want ...string) (before [][]string) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for {
			select {
			case got := <-rounds:
				if slices.Equal(got, want) {
					return before
				}
				before = append(before, got)
			case <-deadline:
				t.Fatalf("no round polled %v within 30 s", want)
			}
		}
	}

	a, b, a2 := h.Subscribe("a"), h.Subscribe("b"), h.Subscribe("a")
	a.Poll()
	round("a")
	woken(t, a, "a polled subscription after its first round")
	notWoken(t, b, "a subscription the poller does not cover")
	notWoken(t, a2, "a subscription to the same key the poller does not cover")

	mu.Lock()
	ready["a"] = true
	mu.Unlock()
	b.Poll() // a round at once, for both keys
	round("a", "b")
	woken(t, a, "a polled subscription whose key is ready")
	woken(t, b, "a polled subscription after its first round")
	notWoken(t, a2, "a subscription to a ready key the poller does not cover")
	a.Cancel()
	a2.Cancel()
	b.Poll() // covered already: a round, no longer for a
	round("b")
	notWoken(t, b, "a polled subscription after its later rounds, its key not ready")
	for len(rounds) > 0 {
		<-rounds
	}
	a.Poll() // cancelled: not covered again
	b.Poll()
	for _, keys := range round("b") {
		if slices.Contains(keys, "a") {
			t.Fatalf("a round polled %v, for a subscription cancelled before it asked", keys)
		}
	}

	h.Close()
	woken(t, b, "a polled subscription at Close")
	c := h.Subscribe("c")
	c.Poll()
	woken(t, c, "a subscription asking to be polled after Close")
	b.Cancel()
	c.Cancel()
	for len(rounds) > 0 {
		if keys := <-rounds; slices.Contains(keys, "c") {
			t.Fatalf("a round after Close polled %v", keys)
		}
	}
}
