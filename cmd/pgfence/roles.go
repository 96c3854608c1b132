package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/runner"
)

// cmdRoles lists the partitions of the continuous roles: their leaders,
// positions and when each last advanced.
func cmdRoles(ctx context.Context, e *env, args []string) error {
	var asJSON bool
	fs, err := parse(e, "roles", args, func(fs *flag.FlagSet) {
		fs.BoolVar(&asJSON, "json", false, "print JSON")
	})
	if err != nil {
		return err
	}
	if fs.NArg() > 1 {
		fs.Usage()
		return fail(exitUsage, "roles takes at most one role name")
	}
	role := fs.Arg(0)
	if role != "" {
		if err := validName("role", role); err != nil {
			return err
		}
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	parts, err := runner.Partitions(ctx, pool, e.schema, role)
	if err != nil {
		return err
	}
	if role != "" && len(parts) == 0 {
		return fail(exitNoJob, "no role %q in schema %s (its partitions appear once they have had a leader)", role, e.schemaName())
	}
	if asJSON {
		if parts == nil {
			parts = []runner.PartitionInfo{}
		}
		return writeJSON(e.stdout, parts)
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ROLE\tPARTITION\tLEADER\tTOKEN\tPOSITION\tLAG\tMOVED\tCOMMITTED\tCOMMITS")
	for _, p := range parts {
		leader, token := "(none)", "-"
		if p.Leading {
			leader, token = printable.String(p.Leader), p.LeaderToken.String()
		}
		ago := func(at time.Time) string {
			if at.IsZero() {
				return "never"
			}
			return round(p.Now.Sub(at)).String() + " ago"
		}
		lag := "-" // no Head reported
		if !p.HeadAt.IsZero() {
			lag = strconv.FormatInt(p.Lag, 10) + " (" + ago(p.HeadAt) + ")"
		}
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%d\n", printable.String(p.Role), p.Partition, leader, token,
			strconv.FormatInt(p.Position, 10), lag, ago(p.AdvancedAt), ago(p.CommittedAt), p.Commits)
	}
	return w.Flush()
}
