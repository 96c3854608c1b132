package runner

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/wait"
)

// Status is the state of a run in the ledger.
type Status string

// Run statuses.
const (
	StatusRunning   Status = "running"
	StatusSucceeded Status = "succeeded"
	StatusFailed    Status = "failed"
	StatusFenced    Status = "fenced"
)

// RunInfo is one row of the ledger (pgfence_runs): the latest attempt at a
// job's (and shard's) slot.
type RunInfo struct {
	Job        string      `json:"job"`
	Shard      int         `json:"shard"`
	Slot       time.Time   `json:"slot"`
	Attempt    int         `json:"attempt"`
	Token      fence.Token `json:"token"`
	Status     Status      `json:"status"`
	Holder     string      `json:"holder"`
	StartedAt  time.Time   `json:"started_at"`
	FinishedAt *time.Time  `json:"finished_at"` // nil while running
	Error      string      `json:"error"`       // "" unless failed or fenced
}

// RunFilter selects runs for Runs. The zero value selects the 20 most
// recent runs of every job.
type RunFilter struct {
	// Job, if set, selects one job's runs.
	Job string
	// Status, if set, selects runs in that state.
	Status Status
	// Limit is the most runs returned. Default 20.
	Limit int
}

// Runs returns recent runs from the ledger in schema ("" means "pgfence"),
// newest first: for dashboards, and for `pgfence jobs`.
func Runs(ctx context.Context, db fence.DB, schema string, f RunFilter) ([]RunInfo, error) {
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("runner: %w", err)
	}
	if f.Limit == 0 {
		f.Limit = 20
	}
	if f.Limit < 0 {
		return nil, fmt.Errorf("runner: RunFilter.Limit %d is negative", f.Limit)
	}
	rows, err := db.Query(ctx, newQueries(schema).runs, f.Job, string(f.Status), f.Limit)
	if err != nil {
		return nil, fmt.Errorf("runner: read the ledger: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	runs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (RunInfo, error) {
		var (
			ri  RunInfo
			tok int64
		)
		err := r.Scan(&ri.Job, &ri.Shard, &ri.Slot, &ri.Attempt, &tok, &ri.Status, &ri.Holder, &ri.StartedAt, &ri.FinishedAt, &ri.Error)
		ri.Token = fence.Token(tok)
		return ri, err
	})
	if err != nil {
		return nil, fmt.Errorf("runner: read the ledger: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	return runs, nil
}

// Prune deletes finished runs that started before before from the ledger in
// schema ("" means "pgfence"), except the latest slot of each job and shard (a new leader
// resumes from it), and returns how many it deleted. Runners call it hourly
// with Config.Retention; `pgfence jobs prune` calls it on demand.
func Prune(ctx context.Context, db fence.DB, schema string, before time.Time) (int64, error) {
	if err := ident.ValidateSchema(schema); err != nil {
		return 0, fmt.Errorf("runner: %w", err)
	}
	tag, err := db.Exec(ctx, newQueries(schema).prune, before)
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
	for {
		if n, err := Prune(ctx, r.pool, r.lcfg.Schema, r.clock.Now().Add(-r.cfg.Retention)); err != nil {
			if ctx.Err() != nil {
				return
			}
			r.log.Warn("pgfence runner: pruning the ledger failed", "err", err)
		} else if n > 0 {
			r.log.Info("pgfence runner: pruned the ledger", "runs", n, "retention", r.cfg.Retention)
		}
		if !wait.Sleep(ctx, pruneEvery) {
			return
		}
	}
}
