package web

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/printable"
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
	// Notice says what a force release just did, as the database shows
	// it now.
	Notice string
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

func (h *Handler) leases(ctx context.Context, r *http.Request) (any, time.Time, error) {
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
		Runner: leaseTable{ID: "runner-leases", Caption: "The runner's leases (pgfence/job/..., pgfence/group/...)", Actions: h.cfg.AllowActions}}
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
	if b.Notice, err = releaseNotice(r, infos); err != nil {
		return nil, time.Time{}, err
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

// releaseNotice says what the force release the page was reached from
// (done=release, with the lease's name and the token released) did, from
// the leases as read now.
func releaseNotice(r *http.Request, infos []lock.Info) (string, error) {
	switch done := r.FormValue("done"); done {
	case "":
		return "", nil
	case "release":
	default:
		return "", badRequest("parameter \"done\": %q is not release", done)
	}
	name := r.FormValue("name")
	tok, err := fence.ParseToken(r.FormValue("token"))
	if err != nil {
		return "", badRequest("parameter \"token\": %v", err)
	}
	i := slices.IndexFunc(infos, func(in lock.Info) bool { return in.Name == name })
	switch {
	case i < 0:
		return fmt.Sprintf("There is no lease %s.", printable.String(name)), nil
	case infos[i].Token > tok:
		in := infos[i]
		return fmt.Sprintf("Lease %s, released at token %s, has been taken since: token %s, held by %s. Writes with token %s are refused.",
			printable.String(name), tok, in.Token, printable.String(in.Holder), tok), nil
	case infos[i].Token == tok && infos[i].Holder == "":
		return fmt.Sprintf("Released lease %s: writes with token %s are refused, and the next holder gets a greater token.",
			printable.String(name), tok), nil
	}
	return fmt.Sprintf("Lease %s is not released: it has token %s, held by %s.", printable.String(name), infos[i].Token, printable.String(infos[i].Holder)), nil
}
