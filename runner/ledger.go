package runner

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
)

// Status is the state of an attempt in the ledger.
type Status string

// Attempt statuses.
const (
	StatusPending   Status = "pending" // a manual run not yet started by its job's leader
	StatusRunning   Status = "running"
	StatusSucceeded Status = "succeeded"
	StatusFailed    Status = "failed"
	StatusPanicked  Status = "panicked"
	StatusFenced    Status = "fenced"  // refused as stale, or taken over by a newer token
	StatusSkipped   Status = "skipped" // a scheduled slot that fell due while its job was paused
)

// Kind says why a slot ran.
type Kind string

// Slot kinds.
const (
	KindScheduled Kind = "scheduled" // a slot of the job's schedule
	KindManual    Kind = "manual"    // a run asked for with RunNow (pgfence jobs run)
)

// RunInfo is one row of the ledger (pgfence_runs): one attempt at a job's
// (and shard's) slot. Every attempt is kept (until Retention prunes it).
type RunInfo struct {
	Job         string      `json:"job"`
	Shard       int         `json:"shard"`
	Kind        Kind        `json:"kind"`
	Slot        time.Time   `json:"slot"` // the schedule's time, or when a manual run was asked for
	Attempt     int         `json:"attempt"`
	Token       fence.Token `json:"token"` // 0 while pending
	Status      Status      `json:"status"`
	Holder      string      `json:"holder"`       // the instance that ran it (while pending: who asked)
	RequestedBy string      `json:"requested_by"` // who asked for a manual run
	StartedAt   time.Time   `json:"started_at"`   // while pending: when asked
	FinishedAt  *time.Time  `json:"finished_at"`  // nil while pending or running
	Error       string      `json:"error"`        // why it failed, panicked, was fenced or skipped
}

// Duration is how long the attempt ran (0 while pending or running).
func (ri RunInfo) Duration() time.Duration {
	if ri.FinishedAt == nil || ri.Status == StatusSkipped {
		return 0
	}
	return ri.FinishedAt.Sub(ri.StartedAt)
}

// RunFilter selects runs for Runs. The zero value selects the 20 most
// recent runs of every job.
type RunFilter struct {
	// Job, if set, selects one job's runs.
	Job string
	// Status, if set, selects runs in that state.
	Status Status
	// Kind, if set, selects runs of that kind (scheduled or manual).
	Kind Kind
	// Limit is the most runs returned. Default 20.
	Limit int
	// Offset skips that many of the newest matching runs: the page of
	// older runs after the first Limit is Offset Limit.
	Offset int
}

// Runs returns recent attempts from the ledger in schema ("" means "pgfence"),
// newest first: for dashboards, and for `pgfence jobs`.
func Runs(ctx context.Context, db fence.DB, schema string, f RunFilter) ([]RunInfo, error) {
	if err := ctxcheck.NotNil(ctx, "runner: Runs"); err != nil {
		return nil, err
	}
	if err := pgexec.NotNil(db, "runner: Runs"); err != nil {
		return nil, err
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("runner: %w", err)
	}
	if f.Limit == 0 {
		f.Limit = 20
	}
	if f.Limit < 0 {
		return nil, fmt.Errorf("runner: RunFilter.Limit %d is negative", f.Limit)
	}
	if f.Offset < 0 {
		return nil, fmt.Errorf("runner: RunFilter.Offset %d is negative", f.Offset)
	}
	rows, err := db.Query(ctx, sqlFor(schema).runs, f.Job, string(f.Status), f.Limit, string(f.Kind), f.Offset)
	if err != nil {
		return nil, fmt.Errorf("runner: read the ledger: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	runs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (RunInfo, error) { return scanRun(r) })
	if err != nil {
		return nil, fmt.Errorf("runner: read the ledger: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	return runs, nil
}

// scanRun reads the ledger columns the runs query selects, in its order.
func scanRun(r pgx.Row, more ...any) (RunInfo, error) {
	var (
		ri  RunInfo
		tok int64
	)
	err := r.Scan(append([]any{&ri.Job, &ri.Shard, &ri.Kind, &ri.Slot, &ri.Attempt, &tok, &ri.Status, &ri.Holder, &ri.RequestedBy,
		&ri.StartedAt, &ri.FinishedAt, &ri.Error}, more...)...)
	ri.Token = fence.Token(tok)
	return ri, err
}

// Prune deletes finished attempts that started before before from the
// ledger in schema ("" means "pgfence"), except those of the latest
// scheduled slot of each job and shard (a new leader resumes from it), and
// returns how many it deleted. Runners call it hourly
// with Config.Retention; `pgfence jobs prune` calls it on demand.
func Prune(ctx context.Context, db fence.DB, schema string, before time.Time) (int64, error) {
	if err := ctxcheck.NotNil(ctx, "runner: Prune"); err != nil {
		return 0, err
	}
	if err := pgexec.NotNil(db, "runner: Prune"); err != nil {
		return 0, err
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return 0, fmt.Errorf("runner: %w", err)
	}
	tag, err := db.Exec(ctx, sqlFor(schema).prune, before)
	if err != nil {
		return 0, fmt.Errorf("runner: prune the ledger: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	return tag.RowsAffected(), nil
}

// pruneEvery is how often a runner prunes the ledger.
const pruneEvery = time.Hour

// prune deletes runs older than Retention now and then every pruneEvery,
// until ctx ends.
func (r *Runner) prune(ctx context.Context) {
	if r.cfg.Retention < 0 {
		return
	}
	var failing retry.Failing
	for {
		if n, err := Prune(ctx, r.pool, r.lcfg.Schema, r.clock.Now().Add(-r.cfg.Retention)); err != nil {
			if ctx.Err() != nil {
				return
			}
			failing.Fail(r.log, "pgfence runner: pruning the ledger failing", err)
		} else {
			failing.Recover(r.log, "pgfence runner: pruning the ledger recovered")
			if n > 0 {
				r.log.Info("pgfence runner: pruned the ledger", "runs", n, "retention", r.cfg.Retention)
			}
		}
		if !wait.Sleep(ctx, pruneEvery) {
			return
		}
	}
}
