package web

import (
	"context"
	"net/http"
	"strings"
	"time"

	"github.com/pgfence/pgfence/internal/schemaver"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// leaseRow is one lease as the leases page shows it.
type leaseRow struct {
	lock.Info
	State leaseState
	Epoch string
}

type leasesBody struct {
	Epoch *schemaver.Epoch
	// The application's leases, and the runner's (pgfence/...) apart.
	App, Runner leaseTable
}

// leaseTable is one table of the leases page.
type leaseTable struct {
	ID, Caption string
	Rows        []leaseRow
	// ShowEpoch: some token was issued before the current history (a
	// failover or a restore happened), so the column says something.
	ShowEpoch bool
	Actions   bool
}

func (h *Handler) leases(ctx context.Context, _ *http.Request) (any, time.Time, error) {
	ep, err := h.epoch(ctx)
	if err != nil {
		return nil, time.Time{}, err
	}
	infos, err := lock.Leases(ctx, h.pool, h.schema)
	if err != nil {
		return nil, time.Time{}, err
	}
	now := time.Now()
	b := leasesBody{Epoch: ep,
		App:    leaseTable{ID: "leases", Caption: "The application's leases", Actions: h.cfg.AllowActions},
		Runner: leaseTable{ID: "runner-leases", Caption: "The runner's leases (pgfence/job/..., pgfence/role/...)", Actions: h.cfg.AllowActions}}
	for i, in := range infos {
		if i == 0 {
			now = in.ExpiresAt.Add(-in.ExpiresIn) // the database's clock
		}
		t := &b.App
		if strings.HasPrefix(in.Name, "pgfence/") {
			t = &b.Runner
		}
		row := leaseRow{Info: in, State: stateOf(in), Epoch: epochText(in.Token, ep)}
		t.ShowEpoch = t.ShowEpoch || strings.HasPrefix(row.Epoch, "before")
		t.Rows = append(t.Rows, row)
	}
	for _, t := range []*leaseTable{&b.App, &b.Runner} {
		sortLeases(t.Rows)
	}
	return b, now, nil
}

type jobsBody struct {
	Jobs []runner.JobInfo
	Runs []runner.RunInfo
	// Job is the job whose attempts Runs lists, "" for every job.
	Job string
}

func (h *Handler) jobs(ctx context.Context, r *http.Request) (any, time.Time, error) {
	b := jobsBody{Job: r.FormValue("job")}
	var err error
	if b.Jobs, err = runner.Jobs(ctx, h.pool, h.schema, ""); err != nil {
		return nil, time.Time{}, err
	}
	if b.Runs, err = runner.Runs(ctx, h.pool, h.schema, runner.RunFilter{Job: b.Job, Limit: h.cfg.Attempts}); err != nil {
		return nil, time.Time{}, err
	}
	now := time.Now()
	if len(b.Jobs) > 0 {
		now = b.Jobs[0].Now
	}
	return b, now, nil
}

func (h *Handler) fleet(ctx context.Context, _ *http.Request) (any, time.Time, error) {
	f, err := h.readFleet(ctx)
	if err != nil {
		return nil, time.Time{}, err
	}
	now := time.Now()
	if len(f.Instances) > 0 {
		now = f.Instances[0].Now
	}
	return f, now, nil
}
