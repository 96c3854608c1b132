package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

func cmdMigrate(ctx context.Context, e *env, args []string) error {
	fs, err := parse(e, "migrate", args, nil)
	if err != nil {
		return err
	}
	switch {
	case fs.NArg() == 0:
		fs.Usage()
		return fail(exitUsage, "migrate needs up or status")
	case fs.NArg() > 1:
		fs.Usage()
		return fail(exitUsage, "migrate takes one argument, up or status; got %d", fs.NArg())
	case fs.Arg(0) == "down":
		return fail(exitUsage, "migrate %q: the CLI takes up or status; it does not undo migrations: "+
			"undoing the leases migration destroys the token history; use migrations.NewProvider for goose's down", fs.Arg(0))
	case fs.Arg(0) != "up" && fs.Arg(0) != "status":
		fs.Usage()
		return fail(exitUsage, "migrate %q: want up or status", fs.Arg(0))
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	if fs.Arg(0) == "up" {
		v, err := migrations.Up(ctx, pool, e.schema)
		if err != nil {
			return err
		}
		fmt.Fprintf(e.stdout, "pgfence schema %s in %s is at version %d\n", printable.String(e.schema), e.target, v)
		return nil
	}
	st, err := migrations.Status(ctx, pool, e.schema)
	if err != nil {
		return err
	}
	where := "schema " + printable.String(st.Schema) + " in " + e.target
	switch {
	case !st.SchemaExists:
		fmt.Fprintf(e.stdout, "%s: no such schema (not migrated; `pgfence migrate up` creates it)\n", where)
	case st.Current == 0:
		fmt.Fprintf(e.stdout, "%s: not migrated\n", where)
	default:
		fmt.Fprintf(e.stdout, "%s: version %d of %d; tokens from %d since %s (timeline %d)\n", where, st.Current, st.Latest,
			st.Epoch.FirstToken, st.Epoch.Started.UTC().Format(time.RFC3339), st.Epoch.Timeline)
	}
	for _, m := range st.Migrations {
		applied := "pending"
		if !m.AppliedAt.IsZero() {
			applied = "applied " + m.AppliedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(e.stdout, "%05d  %-36s %s\n", m.Version, m.Name, applied)
	}
	return nil
}

// writeJSON prints v as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func cmdLeases(ctx context.Context, e *env, args []string) error {
	var asJSON bool
	fs, err := parse(e, "leases", args, func(fs *flag.FlagSet) {
		fs.BoolVar(&asJSON, "json", false, "print JSON")
	})
	if err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fail(exitUsage, "leases takes no arguments")
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	infos, err := lock.Leases(ctx, pool, e.schema)
	if err != nil {
		return err
	}
	if asJSON {
		if infos == nil {
			infos = []lock.Info{}
		}
		return writeJSON(e.stdout, infos) // lock.Info's JSON shape
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "NAME\tHOLDER\tTOKEN\tEXPIRES IN\tHELD FOR")
	for _, i := range infos {
		holder, expires, heldFor := i.Holder, round(i.ExpiresIn).String(), round(i.HeldFor).String()
		if !i.Held {
			expires, heldFor = "-", "-"
			if holder == "" {
				holder = "(free)"
			} else {
				holder += " (expired)"
			}
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%s\n", printable.String(i.Name), printable.String(holder), i.Token, expires, heldFor)
	}
	return w.Flush()
}

func round(d time.Duration) time.Duration {
	if d < 10*time.Second {
		return d.Round(10 * time.Millisecond)
	}
	return d.Round(time.Second)
}

func cmdRelease(ctx context.Context, e *env, args []string) error {
	var (
		yes     bool
		timeout time.Duration
	)
	fs, err := parse(e, "release", args, func(fs *flag.FlagSet) {
		fs.BoolVar(&yes, "yes", false, "do not ask for confirmation")
		fs.DurationVar(&timeout, "timeout", 10*time.Second, "how long to wait for open guarded transactions on the lease")
	})
	if err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return fail(exitUsage, "release takes exactly one lease name")
	}
	if timeout <= 0 {
		return fail(exitUsage, "--timeout must be positive")
	}
	name := fs.Arg(0)
	if err := validName("lease", name); err != nil {
		return err
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	info, err := lock.Inspect(ctx, pool, e.schema, name)
	if errors.Is(err, lock.ErrNoLease) {
		return fail(exitNoLease, "no lease named %q", name)
	}
	if err != nil {
		return err
	}
	found := &info
	if !found.Held {
		why := "free"
		if found.Holder != "" {
			why = "expired: " + printable.String(found.Holder) + " did not renew it"
		}
		fmt.Fprintf(e.stdout, "lease %s is not held (%s; last token %d): nothing to release; the next holder gets token %d or greater\n",
			strconv.Quote(name), why, found.Token, found.Token+1)
		return nil
	}
	if !yes {
		fmt.Fprintf(e.stderr, "Force-release lease %s, held by %s with token %d?\n"+
			"The holder loses it and its writes with token %d will be refused. [y/N] ", strconv.Quote(name), printable.String(found.Holder), found.Token, found.Token)
		var answer string
		_, _ = fmt.Fscanln(e.stdin, &answer)
		if a := strings.ToLower(strings.TrimSpace(answer)); a != "y" && a != "yes" {
			return fail(exitError, "not released (confirm with y, or pass --yes)")
		}
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	freed, err := lock.ForceRelease(rctx, pool, e.schema, name)
	if errors.Is(err, lock.ErrNoLease) {
		return fail(exitNoLease, "no lease named %q", name)
	}
	var blocked *lock.BlockedError
	if errors.As(err, &blocked) {
		return fail(exitError, "not released: %v\n(guarded transactions on the lease are still open; end them, or wait and try again)",
			printable.String(blocked.Error()))
	}
	if err != nil {
		return err
	}
	holder, tok := freed.Holder, freed.Token
	if holder == "" {
		holder = "nobody"
	}
	fmt.Fprintf(e.stdout, "released %s (was held by %s, token %d); the next holder gets token %d or greater\n", strconv.Quote(name), printable.String(holder), tok, tok+1)
	for _, b := range freed.Ended {
		fmt.Fprintf(e.stdout, "ended session %d (%s, user %s), idle in a transaction on the expired lease's row since %s: %s\n",
			b.PID, printable.String(b.Application), printable.String(b.User), b.XactStart.Format(time.RFC3339), printable.String(b.Query))
	}
	return nil
}

func cmdJobs(ctx context.Context, e *env, args []string) error {
	var (
		f      runner.RunFilter
		status string
		asJSON bool
	)
	fs, err := parse(e, "jobs", args, func(fs *flag.FlagSet) {
		fs.IntVar(&f.Limit, "limit", 20, "how many recent attempts")
		fs.StringVar(&f.Job, "job", "", "only this job's attempts")
		fs.StringVar(&status, "status", "", "only attempts in this state: "+statusList)
		fs.BoolVar(&asJSON, "json", false, "print JSON")
	})
	if err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fail(exitUsage, "unknown jobs subcommand %q (%s)", fs.Arg(0), subcommands("jobs"))
	}
	if f.Limit < 1 {
		return fail(exitUsage, "--limit must be at least 1")
	}
	if f.Status = runner.Status(status); status != "" && !slices.Contains(strings.Split(statusList, ", "), status) {
		return fail(exitUsage, "--status must be one of %s", statusList)
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	runs, err := runner.Runs(ctx, pool, e.schema, f)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(e.stdout, runs)
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "JOB\tSHARD\tKIND\tSLOT\tATTEMPT\tTOKEN\tSTATUS\tHOLDER\tDURATION\tERROR")
	for _, r := range runs {
		dur := "-"
		if r.FinishedAt != nil {
			dur = round(r.Duration()).String()
		}
		msg := strings.SplitN(r.Error, "\n", 2)[0]
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%d\t%d\t%s\t%s\t%s\t%s\n", printable.String(r.Job), r.Shard, r.Kind, r.Slot.UTC().Format(time.RFC3339),
			r.Attempt, r.Token, r.Status, printable.String(r.Holder), dur, printable.String(msg))
	}
	return w.Flush()
}

// statusList names the attempt statuses --status accepts.
const statusList = "pending, running, succeeded, failed, panicked, fenced, skipped"

func cmdJobsPrune(ctx context.Context, e *env, args []string) error {
	var olderThan time.Duration
	if _, err := parse(e, "jobs prune", args, func(fs *flag.FlagSet) {
		fs.DurationVar(&olderThan, "older-than", 0, "delete finished runs that started longer ago than this (e.g. 720h)")
	}); err != nil {
		return err
	}
	if olderThan <= 0 {
		return fail(exitUsage, "jobs prune needs a positive --older-than, e.g. --older-than 720h")
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	n, err := runner.Prune(ctx, pool, e.schema, time.Now().Add(-olderThan))
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "pruned %d runs older than %v (the latest slot of each job and shard is kept)\n", n, olderThan)
	return nil
}

// validName refuses a name no lease, job or consumer group can have, as a usage
// error (exit 2) that says what is wrong with it.
func validName(kind, name string) error {
	if err := fence.ValidateName(name); err != nil {
		shown := printable.String(name)
		if len(shown) > 40 {
			shown = shown[:40] + "..."
		}
		return fail(exitUsage, "%s name %q: %v", kind, shown, err)
	}
	return nil
}
