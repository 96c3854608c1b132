package web_test

import (
	"context"
	"errors"
	"github.com/jackc/pgx/v5"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
	"github.com/pgfence/pgfence/web"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// rig is a live schema with a running runner (instance "app-1") and a
// status page on it.
type rig struct {
	db   *pgtest.DB
	app  *lock.Client // the application's client: its runner, its leases
	srv  *httptest.Server
	logs *pgtest.Logs
}

// failing is the error text of the job that always fails: HTML, a script,
// a control character and a bidirectional override, shown as text.
const failing = "<script>window.pwned = true</script><b>boom</b>\x1b[31m \u202eevil"

// newRig starts a runner with a job that succeeds ("tick", every second)
// and two that fail ("charge", every 300ms, its error the text failing;
// "nightly-billing", every 2s),
// and serves the status page of its schema with cfg.
func newRig(t *testing.T, cfg web.Config) *rig {
	t.Helper()
	db := pgtest.New(t)
	rg := &rig{db: db, logs: pgtest.NewLogs()}
	rg.app = db.Client(t, lock.Config{Holder: "app-1", TTL: 2 * time.Second, PollInterval: 100 * time.Millisecond})
	r, err := runner.New(rg.app, runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, j := range []runner.Job{
		{Name: "tick", Schedule: "@every 1s", Run: func(context.Context, *runner.Run) error { return nil }},
		{Name: "charge", Schedule: "@every 300ms", Run: func(context.Context, *runner.Run) error { return errors.New(failing) }},
		{Name: "nightly-billing", Schedule: "@every 2s", Run: func(context.Context, *runner.Run) error {
			return errors.New("charge customer 1042: payment provider answered 402 Payment Required")
		}},
	} {
		if err := r.Register(j); err != nil {
			t.Fatal(err)
		}
	}
	// A consumer group whose two partitions each commit offset 3 once,
	// with 5 available (a lag of 2).
	end := func(context.Context, int) (int64, error) { return 5, nil }
	if err := r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 2, End: end, Consume: func(ctx context.Context, p *runner.Partition) error {
		if p.Offset() == 0 {
			if err := p.Commit(ctx, func(context.Context, pgx.Tx) (int64, error) { return 3, nil }); err != nil {
				return err
			}
		}
		return p.Wait(ctx)
	}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runner: %v", err)
		}
	})
	if cfg.Logger == nil {
		cfg.Logger = slog.New(rg.logs)
	}
	cfg.Schema = db.Schema
	h, err := web.New(db.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	rg.srv = httptest.NewServer(h)
	t.Cleanup(rg.srv.Close)
	return rg
}

// httptestServer serves h for the test and returns its URL.
func httptestServer(t *testing.T, h http.Handler) string {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}
