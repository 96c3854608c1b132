package web

import (
	"context"
	"net/http"
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
	Epoch  *schemaver.Epoch
	Leases []leaseRow
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
	b := leasesBody{Epoch: ep, Leases: make([]leaseRow, 0, len(infos))}
	for i, in := range infos {
		if i == 0 {
			now = in.ExpiresAt.Add(-in.ExpiresIn) // the database's clock
		}
		b.Leases = append(b.Leases, leaseRow{Info: in, State: stateOf(in), Epoch: epochText(in.Token, ep)})
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
