package runner_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// Every function that takes a context refuses a nil one with
// fence.ErrNilContext, naming the call, before it touches the database.
// Formerly each panicked inside pgx (Runner.Observe in a goroutine of the
// lock client, taking the process down), and Runner.Run(nil) left the
// runner marked running, so a later Run returned ErrRunning.
func TestNilContext(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	r, err := runner.New(lockClient(t, db.Pool, lock.Config{Schema: db.Schema}), runner.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Register(runner.Job{Name: "j", Schedule: "@every 1h", Run: func(context.Context, *runner.Run) error { return nil }}); err != nil {
		t.Fatal(err)
	}
	var (
		nilCtx context.Context
		run    runner.Run // a zero Run: the check comes before its lease is used
		noop   = func(pgx.Tx) error { return nil }
	)
	calls := []struct {
		op   string
		call func() error
	}{
		{"Pause", func() error { return runner.Pause(nilCtx, db.Pool, db.Schema, "j", "test") }},
		{"Resume", func() error { return runner.Resume(nilCtx, db.Pool, db.Schema, "j") }},
		{"RunNow", func() error { _, err := runner.RunNow(nilCtx, db.Pool, db.Schema, "j", 0, "test"); return err }},
		{"WaitRun", func() error {
			_, err := runner.WaitRun(nilCtx, db.Pool, db.Schema, runner.RunRef{Job: "j"})
			return err
		}},
		{"Jobs", func() error { _, err := runner.Jobs(nilCtx, db.Pool, db.Schema, ""); return err }},
		{"Runs", func() error { _, err := runner.Runs(nilCtx, db.Pool, db.Schema, runner.RunFilter{}); return err }},
		{"Prune", func() error { _, err := runner.Prune(nilCtx, db.Pool, db.Schema, time.Now()); return err }},
		{"Instances", func() error { _, err := runner.Instances(nilCtx, db.Pool, db.Schema); return err }},
		{"Terms", func() error { _, err := runner.Terms(nilCtx, db.Pool, db.Schema, runner.TermFilter{}); return err }},
		{"Runner.Observe", func() error { _, err := r.Observe(nilCtx, "j", 0); return err }},
		{"Runner.Run", func() error { return r.Run(nilCtx) }},
		{"Run.RunTx", func() error { return run.RunTx(nilCtx, noop) }},
		{"Run.CommitTx", func() error { return run.CommitTx(nilCtx, noop) }},
	}
	for _, tc := range calls {
		err := pgtest.NoPanic(tc.call)
		if !errors.Is(err, fence.ErrNilContext) || !strings.HasPrefix(err.Error(), "runner: "+tc.op+": ") {
			t.Errorf("%s with a nil context: %v; want \"runner: %s: \" and fence.ErrNilContext", tc.op, err, tc.op)
		}
	}

	// Run(nil) left the runner as it was: it still runs.
	ctx, cancel := context.WithCancel(pgtest.Context(t, time.Minute))
	cancel()
	if err := r.Run(ctx); err != nil {
		t.Fatalf("Run after Run(nil): %v", err)
	}
}

// The operators' functions refuse a nil executor with fence.ErrNilDB,
// naming the call, instead of panicking.
func TestNilDB(t *testing.T) {
	ctx := context.Background()
	calls := []struct {
		name string
		call func() error
	}{
		{"Pause", func() error { return runner.Pause(ctx, nil, "", "j", "op") }},
		{"Resume", func() error { return runner.Resume(ctx, nil, "", "j") }},
		{"RunNow", func() error { _, err := runner.RunNow(ctx, nil, "", "j", 0, "op"); return err }},
		{"Jobs", func() error { _, err := runner.Jobs(ctx, nil, "", ""); return err }},
		{"Runs", func() error { _, err := runner.Runs(ctx, nil, "", runner.RunFilter{}); return err }},
		{"Instances", func() error { _, err := runner.Instances(ctx, nil, ""); return err }},
		{"Terms", func() error { _, err := runner.Terms(ctx, nil, "", runner.TermFilter{}); return err }},
		{"Prune", func() error { _, err := runner.Prune(ctx, nil, "", time.Now()); return err }},
		{"Leases", func() error { _, err := lock.Leases(ctx, nil, ""); return err }},
		{"Inspect", func() error { _, err := lock.Inspect(ctx, nil, "", "x"); return err }},
	}
	for _, c := range calls {
		err := c.call()
		if !errors.Is(err, fence.ErrNilDB) || !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s(nil db): %v, want fence.ErrNilDB naming the call", c.name, err)
		}
	}
}
