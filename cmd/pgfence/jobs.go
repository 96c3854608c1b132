package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/runner"
)

// The jobs subcommands that steer the runner: status, run, pause, resume.

func cmdJobsStatus(ctx context.Context, e *env, args []string) error {
	var asJSON bool
	fs, err := parse(e, "jobs status", args, func(fs *flag.FlagSet) {
		fs.BoolVar(&asJSON, "json", false, "print JSON")
	})
	if err != nil {
		return err
	}
	if fs.NArg() > 1 {
		fs.Usage()
		return fail(exitUsage, "jobs status takes at most one job name")
	}
	job := fs.Arg(0)
	if job != "" {
		if err := validName("job", job); err != nil {
			return err
		}
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	jobs, err := runner.Jobs(ctx, pool, e.schema, job)
	if err != nil {
		return err
	}
	if job != "" && len(jobs) == 0 {
		return fail(exitNoJob, "no job %q in schema %s (runners register their jobs when they start)", job, e.schemaName())
	}
	// A job without a leader runs nowhere: say so in the exit code, after
	// the listing, for scripts and health checks.
	var leaderless []string
	for _, j := range jobs {
		if j.Leader == "" {
			name := printable.String(j.Job)
			if j.Shards > 0 {
				name += "#" + strconv.Itoa(j.Shard)
			}
			leaderless = append(leaderless, name)
		}
	}
	noLeader := func(err error) error {
		if err != nil || len(leaderless) == 0 {
			return err
		}
		return fail(exitNoLeader, "%d without a leader (running nowhere): %s", len(leaderless), strings.Join(leaderless, ", "))
	}
	if asJSON {
		if jobs == nil {
			jobs = []runner.JobInfo{}
		}
		return noLeader(writeJSON(e.stdout, jobs))
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "JOB\tSHARD\tLEADER\tTOKEN\tSINCE\tLAST SLOT\tSTATUS\tATTEMPT\tDURATION\tNEXT\tMISSED\tPENDING\tPAUSED")
	for _, j := range jobs {
		leader, token, since := "-", "-", "-"
		if j.Leader != "" {
			leader, token = printable.String(j.Leader), j.Token.String()
			if j.LeaderSince != nil {
				since = round(j.Now.Sub(*j.LeaderSince)).String() + " ago"
			}
		}
		last, status, attempt, dur := "-", "-", "-", "-"
		if l := j.Last; l != nil {
			last, status, attempt = l.Slot.UTC().Format(time.RFC3339), string(l.Status), strconv.Itoa(l.Attempt)
			if l.FinishedAt != nil {
				dur = round(l.Duration()).String()
			}
		}
		next := "-"
		if !j.Next.IsZero() {
			next = j.Next.UTC().Format(time.RFC3339)
		}
		paused := "no"
		if j.Paused {
			paused = "by " + printable.String(j.PausedBy) + " at " + j.PausedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t%s\n", printable.String(j.Job), j.Shard, leader, token, since,
			last, status, attempt, dur, next, j.Missed, j.Pending, paused)
	}
	return noLeader(w.Flush())
}

func cmdJobsRun(ctx context.Context, e *env, args []string) error {
	var (
		shard   int
		waitFor bool
		timeout time.Duration
	)
	fs, err := parse(e, "jobs run", args, func(fs *flag.FlagSet) {
		fs.IntVar(&shard, "shard", runner.AllShards, "only this shard (default: every shard; 0 for an unsharded job)")
		fs.BoolVar(&waitFor, "wait", false, "wait for the outcome and exit with it (0 succeeded, 5 failed)")
		fs.DurationVar(&timeout, "timeout", 0, "with --wait, give up after this long (default: no limit)")
	})
	if err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return fail(exitUsage, "jobs run takes exactly one job name")
	}
	if shard < runner.AllShards {
		return fail(exitUsage, "--shard must be 0 or more")
	}
	if timeout < 0 || (timeout > 0 && !waitFor) {
		return fail(exitUsage, "--timeout must be positive, and goes with --wait")
	}
	job := fs.Arg(0)
	if err := validName("job", job); err != nil {
		return err
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	refs, err := runner.RunNow(ctx, pool, e.schema, job, shard, operator())
	if err != nil {
		return noJob(err, job, e)
	}
	for _, r := range refs {
		fmt.Fprintf(e.stdout, "asked for a run of %s shard %d (slot %s); its leader runs it next\n",
			strconv.Quote(job), r.Shard, r.Slot.UTC().Format(time.RFC3339Nano))
	}
	if !waitFor {
		return nil
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	failed := 0
	for _, r := range refs {
		ri, err := runner.WaitRun(ctx, pool, e.schema, r)
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) {
				return fail(exitError, "no outcome for shard %d within %v (status %s)", r.Shard, timeout, ri.Status)
			}
			return err
		}
		fmt.Fprintf(e.stdout, "shard %d: %s after %d attempt(s), token %s, on %s, in %v\n", ri.Shard, ri.Status, ri.Attempt,
			ri.Token, printable.String(ri.Holder), round(ri.Duration()))
		if ri.Status != runner.StatusSucceeded {
			failed++
			fmt.Fprintf(e.stdout, "  error: %s\n", printable.String(strings.SplitN(ri.Error, "\n", 2)[0]))
		}
	}
	if failed > 0 {
		return fail(exitRunFailed, "%d of %d run(s) of %s did not succeed", failed, len(refs), strconv.Quote(job))
	}
	return nil
}

func cmdJobsPause(ctx context.Context, e *env, args []string) error {
	return jobsPause(ctx, e, "pause", args)
}

func cmdJobsResume(ctx context.Context, e *env, args []string) error {
	return jobsPause(ctx, e, "resume", args)
}

func jobsPause(ctx context.Context, e *env, verb string, args []string) error {
	fs, err := parse(e, "jobs "+verb, args, nil)
	if err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return fail(exitUsage, "jobs %s takes exactly one job name", verb)
	}
	job := fs.Arg(0)
	if err := validName("job", job); err != nil {
		return err
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	if verb == "pause" {
		// Pausing a paused job keeps the first pause: say so.
		if jobs, err := runner.Jobs(ctx, pool, e.schema, job); err == nil && len(jobs) > 0 && jobs[0].Paused {
			fmt.Fprintf(e.stdout, "%s was already paused by %s at %s; nothing changed\n", strconv.Quote(job),
				printable.String(jobs[0].PausedBy), (*jobs[0].PausedAt).UTC().Format(time.RFC3339))
			return nil
		}
		err = runner.Pause(ctx, pool, e.schema, job, operator())
	} else {
		err = runner.Resume(ctx, pool, e.schema, job)
	}
	if err != nil {
		return noJob(err, job, e)
	}
	if verb == "pause" {
		fmt.Fprintf(e.stdout, "paused %s: no replica starts its scheduled slots until pgfence jobs resume %s\n",
			strconv.Quote(job), strconv.Quote(job))
	} else {
		fmt.Fprintf(e.stdout, "resumed %s: it runs from its next slot\n", strconv.Quote(job))
	}
	return nil
}

// noJob gives an unknown job or shard its exit code.
func noJob(err error, job string, e *env) error {
	switch {
	case errors.Is(err, runner.ErrUnknownJob):
		return fail(exitNoJob, "no job %q in schema %s (runners register their jobs when they start; pgfence jobs status lists them)",
			job, e.schemaName())
	case errors.Is(err, runner.ErrNoSuchShard):
		return fail(exitNoJob, "%v", err)
	}
	return err
}

// operator names who is steering: user@host, for the ledger and status.
func operator() string {
	name := "unknown"
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	host, _ := os.Hostname()
	return "pgfence-cli:" + name + "@" + host
}
