package web

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/runner"
)

// The job page: one job's schedule, leaders, terms and attempts.

// statusError is a page's answer other than 500: its code and what to say.
type statusError struct {
	code int
	msg  string
}

func (e *statusError) Error() string { return e.msg }

func badRequest(format string, args ...any) error {
	return &statusError{http.StatusBadRequest, fmt.Sprintf(format, args...)}
}

func notFound(format string, args ...any) error {
	return &statusError{http.StatusNotFound, fmt.Sprintf(format, args...)}
}

// jobBody is what the job page shows.
type jobBody struct {
	Job      string
	Schedule string      // as registered
	Words    string      // the schedule in words
	Next     []time.Time // the next few slots
	Shards   []runner.JobInfo
	Failing  map[int]failures // consecutive failures by shard
	Terms    chart            // the leadership timeline
	RunChart chart            // the attempts on this page as bars
	Runs     []runner.RunInfo
	// The attempts' filter and page.
	Status, Kind string
	Page         int
	More         bool // an older page exists
	Statuses     []runner.Status
	Kinds        []runner.Kind
	// Notice says what an action just did, as the database shows it now.
	Notice string
}

// failures counts one shard's failed attempts in a row, newest first;
// AtLeast when every attempt read failed (older ones were not read).
type failures struct {
	N       int
	AtLeast bool
}

// recentAttempts is how many of a job's newest attempts the consecutive
// failures are counted in, and timelineTerms how many terms the
// leadership timeline draws.
const (
	recentAttempts = 200
	timelineTerms  = 30
	nextSlots      = 3
)

var (
	allStatuses = []runner.Status{runner.StatusPending, runner.StatusRunning, runner.StatusSucceeded, runner.StatusFailed,
		runner.StatusPanicked, runner.StatusFenced, runner.StatusSkipped}
	allKinds = []runner.Kind{runner.KindScheduled, runner.KindManual}
)

// jobFilter reads the job page's parameters: the job's name, and the
// attempts' status, kind and page, each checked against what exists.
func jobFilter(r *http.Request) (name, status, kind string, page int, err error) {
	name, status, kind = r.FormValue("name"), r.FormValue("status"), r.FormValue("kind")
	if name == "" {
		return "", "", "", 0, badRequest("parameter \"name\" (the job) is missing")
	}
	if status != "" && !knownStatus(status) {
		return "", "", "", 0, badRequest("parameter \"status\": %q is not a status of an attempt", status)
	}
	if kind != "" && kind != string(runner.KindScheduled) && kind != string(runner.KindManual) {
		return "", "", "", 0, badRequest("parameter \"kind\": %q is not scheduled or manual", kind)
	}
	page = 1
	if s := r.FormValue("page"); s != "" {
		if page, err = strconv.Atoi(s); err != nil || page < 1 || page > 100_000 {
			return "", "", "", 0, badRequest("parameter \"page\": %q is not a page number", s)
		}
	}
	return name, status, kind, page, nil
}

func knownStatus(s string) bool {
	for _, st := range allStatuses {
		if string(st) == s {
			return true
		}
	}
	return false
}

func (h *Handler) job(ctx context.Context, r *http.Request) (any, time.Time, error) {
	name, status, kind, page, err := jobFilter(r)
	if err != nil {
		return nil, time.Time{}, err
	}
	b := jobBody{Job: name, Status: status, Kind: kind, Page: page, Statuses: allStatuses, Kinds: allKinds}
	if b.Shards, err = runner.Jobs(ctx, h.pool, h.schema, name); err != nil {
		return nil, time.Time{}, err
	}
	if len(b.Shards) == 0 {
		return nil, time.Time{}, notFound("no job named %q is registered in schema %s", name, h.schema)
	}
	now := b.Shards[0].Now
	b.Schedule = b.Shards[0].Schedule
	b.Words = scheduleWords(b.Schedule)
	if s, err := runner.ParseSchedule(b.Schedule); err == nil {
		for t := now; len(b.Next) < nextSlots; {
			if t = s.Next(t); t.IsZero() {
				break
			}
			b.Next = append(b.Next, t)
		}
	}
	recent, err := runner.Runs(ctx, h.pool, h.schema, runner.RunFilter{Job: name, Limit: recentAttempts})
	if err != nil {
		return nil, time.Time{}, err
	}
	b.Failing = consecutiveFailures(recent, len(recent) == recentAttempts)
	per := h.cfg.Attempts
	runs, err := runner.Runs(ctx, h.pool, h.schema, runner.RunFilter{Job: name, Status: runner.Status(status),
		Kind: runner.Kind(kind), Limit: per + 1, Offset: (page - 1) * per})
	if err != nil {
		return nil, time.Time{}, err
	}
	if b.More = len(runs) > per; b.More {
		runs = runs[:per]
	}
	b.Runs = runs
	terms, err := runner.Terms(ctx, h.pool, h.schema, runner.TermFilter{Job: name, Limit: timelineTerms})
	if err != nil {
		return nil, time.Time{}, err
	}
	fenced, err := runner.Runs(ctx, h.pool, h.schema, runner.RunFilter{Job: name, Status: runner.StatusFenced, Limit: recentAttempts})
	if err != nil {
		return nil, time.Time{}, err
	}
	if b.Notice, err = jobNotice(r, b.Shards, recent); err != nil {
		return nil, time.Time{}, err
	}
	b.Terms = leadershipChart(terms, b.Shards, fenced, now)
	b.RunChart = attemptsChart(runs, b.Shards[0].Shards, now)
	return b, now, nil
}

// consecutiveFailures counts, per shard, the attempts that failed,
// panicked or were fenced since the shard's latest success, in runs (newest
// first); attempts still pending or running, and skipped slots, neither
// count nor end the streak. truncated says runs is not the whole ledger:
// a streak that reaches its end is "at least".
func consecutiveFailures(runs []runner.RunInfo, truncated bool) map[int]failures {
	out := map[int]failures{}
	done := map[int]bool{}
	for _, ri := range runs {
		if done[ri.Shard] {
			continue
		}
		switch ri.Status {
		case runner.StatusSucceeded:
			done[ri.Shard] = true
		case runner.StatusFailed, runner.StatusPanicked, runner.StatusFenced:
			f := out[ri.Shard]
			f.N++
			out[ri.Shard] = f
		}
	}
	if truncated {
		for s, f := range out {
			if !done[s] {
				f.AtLeast = true
				out[s] = f
			}
		}
	}
	return out
}

// jobNotice says what the action the page was reached from (done: run,
// pause or resume) did, from what the database says now, so that a link
// someone made up cannot claim what did not happen.
func jobNotice(r *http.Request, shards []runner.JobInfo, recent []runner.RunInfo) (string, error) {
	job := shards[0].Job
	switch done := r.FormValue("done"); done {
	case "":
		return "", nil
	case "run":
		slot, err := time.Parse(time.RFC3339Nano, r.FormValue("slot"))
		if err != nil {
			return "", badRequest("parameter \"slot\": %q is not a time", r.FormValue("slot"))
		}
		var states []string
		for _, ri := range recent {
			if ri.Kind == runner.KindManual && ri.Slot.Equal(slot) {
				where := ""
				if shards[0].Shards > 0 {
					where = fmt.Sprintf("shard %d: ", ri.Shard)
				}
				states = append(states, fmt.Sprintf("%sattempt %d %s", where, ri.Attempt, ri.Status))
			}
		}
		if len(states) == 0 {
			return fmt.Sprintf("No manual run of %s asked for at %s is in the recent ledger.", printable.String(job), slot.UTC().Format(time.RFC3339)), nil
		}
		return fmt.Sprintf("Asked for a run of %s (%s): %s.", printable.String(job), slot.UTC().Format(time.RFC3339), strings.Join(states, "; ")), nil
	case "pause", "resume":
		if ji := shards[0]; ji.Paused {
			return fmt.Sprintf("%s is paused (by %s): no replica starts its scheduled slots; manual runs still run.",
				printable.String(job), printable.String(ji.PausedBy)), nil
		}
		return fmt.Sprintf("%s is not paused: it runs from its next slot.", printable.String(job)), nil
	default:
		return "", badRequest("parameter \"done\": %q is not run, pause or resume", done)
	}
}
