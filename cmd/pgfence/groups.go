package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/runner"
)

// cmdGroups lists the partitions of the consumer groups: their leaders,
// committed offsets, lag and when each last moved.
func cmdGroups(ctx context.Context, e *env, args []string) error {
	var asJSON bool
	fs, err := parse(e, "groups", args, func(fs *flag.FlagSet) {
		fs.BoolVar(&asJSON, "json", false, "print JSON")
	})
	if err != nil {
		return err
	}
	if fs.NArg() > 1 {
		fs.Usage()
		return fail(exitUsage, "groups takes at most one consumer group name")
	}
	group := fs.Arg(0)
	if group != "" {
		if err := validName("consumer group", group); err != nil {
			return err
		}
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	parts, err := runner.Partitions(ctx, pool, e.schema, group)
	if err != nil {
		return err
	}
	if group != "" && len(parts) == 0 {
		return fail(exitNoJob, "no consumer group %q in schema %s (its partitions appear once they have had a leader)", group, e.schemaName())
	}
	if asJSON {
		if parts == nil {
			parts = []runner.PartitionInfo{}
		}
		return writeJSON(e.stdout, parts)
	}
	groups, err := runner.Groups(ctx, pool, e.schema, group)
	if err != nil {
		return err
	}
	for _, g := range groups {
		if g.Next != 0 {
			fmt.Fprintf(e.stdout, "group %s: changing from %d to %d partitions at offset %d (asked by %s): %d of %d partitions through the cut\n",
				printable.String(g.Group), g.Partitions, g.Next, g.Cut, printable.String(g.ChangeBy), g.Drained, g.Partitions)
		}
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "GROUP\tPARTITION\tLEADER\tTOKEN\tOFFSET\tEND\tLAG\tMOVED\tCOMMITTED\tCOMMITS")
	for _, p := range parts {
		ago := func(at time.Time) string {
			if at.IsZero() {
				return "never"
			}
			return round(p.Now.Sub(at)).String() + " ago"
		}
		leader, token := "(none)", "-"
		switch {
		case p.Leading:
			leader, token = printable.String(p.Leader), p.LeaderToken.String()
		case !p.LeaderlessSince.IsZero():
			leader = "(none for " + round(p.Now.Sub(p.LeaderlessSince)).String() + ")"
		}
		end, lag := "-", "-" // no end offset reported (Consumer.End)
		if !p.EndAt.IsZero() {
			end, lag = strconv.FormatInt(p.End, 10), strconv.FormatInt(p.Lag, 10)+" ("+ago(p.EndAt)+")"
		}
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%d\n", printable.String(p.Group), p.Partition, leader, token,
			p.Offset, end, lag, ago(p.AdvancedAt), ago(p.CommittedAt), p.Commits)
	}
	return w.Flush()
}

// cmdGroupsSeek sets a partition's committed offset through its fence.
func cmdGroupsSeek(ctx context.Context, e *env, args []string) error {
	var (
		yes     bool
		timeout time.Duration
	)
	fs, err := parse(e, "groups seek", args, func(fs *flag.FlagSet) {
		fs.BoolVar(&yes, "yes", false, "do not ask for confirmation")
		fs.DurationVar(&timeout, "timeout", 10*time.Second, "how long to wait for the partition's open guarded transactions")
	})
	if err != nil {
		return err
	}
	if fs.NArg() != 3 {
		fs.Usage()
		return fail(exitUsage, "groups seek takes a consumer group, a partition and an offset")
	}
	group := fs.Arg(0)
	if err := validName("consumer group", group); err != nil {
		return err
	}
	partition, err := strconv.Atoi(fs.Arg(1))
	if err != nil || partition < 0 {
		return fail(exitUsage, "partition %q is not a partition number", fs.Arg(1))
	}
	offset, err := strconv.ParseInt(fs.Arg(2), 10, 64)
	if err != nil || offset < 0 {
		return fail(exitUsage, "offset %q is not an offset (0 or more)", fs.Arg(2))
	}
	if timeout <= 0 {
		return fail(exitUsage, "--timeout must be positive")
	}
	if !yes {
		fmt.Fprintf(e.stderr, "Set partition %d of consumer group %s to offset %d?\n"+
			"Its leader's term is revoked (its commits are refused from then on); the next leader resumes at %d. [y/N] ",
			partition, strconv.Quote(group), offset, offset)
		var answer string
		_, _ = fmt.Fscanln(e.stdin, &answer)
		if a := strings.ToLower(strings.TrimSpace(answer)); a != "y" && a != "yes" {
			return fail(exitError, "not sought (confirm with y, or pass --yes)")
		}
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	sctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	before, err := runner.Seek(sctx, pool, e.schema, group, partition, offset, operator())
	switch {
	case errors.Is(err, runner.ErrUnknownJob):
		return fail(exitNoJob, "no partition %d of consumer group %q has had a leader in schema %s", partition, group, e.schemaName())
	case errors.Is(err, context.DeadlineExceeded):
		return fail(exitError, "not sought: the partition's guarded transactions did not end within %v", timeout)
	case err != nil:
		return err
	}
	fmt.Fprintf(e.stdout, "partition %d of %s: offset %d -> %d; its leader's term was revoked\n", partition, strconv.Quote(group), before, offset)
	return nil
}

// cmdGroupsPartitions changes a consumer group's partition count.
func cmdGroupsPartitions(ctx context.Context, e *env, args []string) error {
	fs, err := parse(e, "groups partitions", args, func(*flag.FlagSet) {})
	if err != nil {
		return err
	}
	if fs.NArg() != 2 {
		fs.Usage()
		return fail(exitUsage, "groups partitions takes a consumer group and a partition count")
	}
	group := fs.Arg(0)
	if err := validName("consumer group", group); err != nil {
		return err
	}
	n, err := strconv.Atoi(fs.Arg(1))
	if err != nil || n < 1 || n > 1<<16 {
		return fail(exitUsage, "partition count %q is not a number from 1 to 65536", fs.Arg(1))
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	before, err := runner.SetPartitions(ctx, pool, e.schema, group, n, operator())
	switch {
	case errors.Is(err, runner.ErrUnknownJob):
		return fail(exitNoJob, "no consumer group %q in schema %s", group, e.schemaName())
	case err != nil:
		return err
	}
	groups, err := runner.Groups(ctx, pool, e.schema, group)
	if err != nil {
		return err
	}
	if len(groups) == 1 && groups[0].Next == n {
		fmt.Fprintf(e.stdout, "group %s: changing from %d to %d partitions at offset %d; it ends when every partition is through the cut (pgfence groups %s)\n",
			strconv.Quote(group), before, n, groups[0].Cut, group)
		return nil
	}
	fmt.Fprintf(e.stdout, "group %s: %d partitions (was %d)\n", strconv.Quote(group), n, before)
	return nil
}
