package main

import (
	"context"
	"fmt"
	"strings"
)

// command is one CLI command: the table below is the one list of them.
// Dispatch, the usage text and each command's own usage line come from it,
// and a test checks that the package documentation lists every one.
type command struct {
	name     string // "leases", or "jobs status" for a subcommand
	synopsis string // its flags and arguments
	help     string // what it does, one line
	run      func(ctx context.Context, e *env, args []string) error
}

// commands is filled in init: the help command prints the table itself.
var commands []command

func init() {
	commands = []command{
		{"migrate", "up|status", "apply or show pgfence's schema migrations", cmdMigrate},
		{"leases", "[--json]", "list leases: name, holder, token, expires in, held for", cmdLeases},
		{"release", "NAME [--yes] [--timeout 10s]", "force-free a lease; its holder is fenced", cmdRelease},
		{"run", "--lease NAME [--ttl 15s] [--wait] [--grace 10s] -- COMMAND [ARGS...]",
			"run COMMAND while holding the lease, like flock(1) across hosts", cmdRun},
		{"jobs", "[--limit 20] [--job NAME] [--status S] [--json]", "recent attempts from the runner's ledger", cmdJobs},
		{"jobs status", "[JOB] [--json]", "each job and shard: leader, token, last slot, next slot, missed, paused", cmdJobsStatus},
		{"jobs run", "JOB [--shard N] [--wait] [--timeout D]",
			"run JOB once now on the replica that leads it (--wait: exit with its outcome)", cmdJobsRun},
		{"jobs pause", "JOB", "stop every replica starting JOB's scheduled slots", cmdJobsPause},
		{"jobs resume", "JOB", "let the replicas start JOB's scheduled slots again", cmdJobsResume},
		{"jobs prune", "--older-than D", "delete finished runs older than D (the latest slot of each job is kept)", cmdJobsPrune},
		{"groups", "[GROUP] [--json]", "each consumer group's partitions: leader, token, offset, end, lag, when it last moved", cmdGroups},
		{"groups seek", "GROUP PARTITION OFFSET [--yes] [--timeout 10s]",
			"set a partition's committed offset, fenced: its leader's term is revoked", cmdGroupsSeek},
		{"groups partitions", "GROUP N", "change a consumer group's partition count (through a cut while replicas run it)", cmdGroupsPartitions},
		{"grant", "app|operator ROLE [--print]", "give ROLE what an application (or this CLI) needs in the schema", cmdGrant},
		{"ui", "[--listen 127.0.0.1:8080] [--host NAME] [--allow-actions] [--refresh 1s]",
			"serve the status page (leases, jobs, fleet) in a browser", cmdUI},
		{"version", "", "print the module version and the commit it was built from", cmdVersion},
		{"help", "", "print this list", cmdHelp},
	}
}

// lookup finds the command args start with: a subcommand ("jobs status")
// before its parent ("jobs"). It returns the command and the arguments
// after its name.
func lookup(args []string) (command, []string, bool) {
	if len(args) == 0 {
		return command{}, nil, false
	}
	if len(args) > 1 {
		for _, c := range commands {
			if c.name == args[0]+" "+args[1] {
				return c, args[2:], true
			}
		}
	}
	for _, c := range commands {
		if c.name == args[0] {
			return c, args[1:], true
		}
	}
	return command{}, nil, false
}

// synopsisOf is name's synopsis from the table.
func synopsisOf(name string) string {
	for _, c := range commands {
		if c.name == name {
			return c.synopsis
		}
	}
	return ""
}

// subcommands lists parent's subcommands' last words ("status, run, ...").
func subcommands(parent string) string {
	var subs []string
	for _, c := range commands {
		if sub, ok := strings.CutPrefix(c.name, parent+" "); ok {
			subs = append(subs, sub)
		}
	}
	return strings.Join(subs, ", ")
}

// usageText is the usage message: every command of the table.
func usageText() string {
	var b strings.Builder
	b.WriteString("usage: pgfence [--database-url URL] [--schema NAME] COMMAND [flags] [args]\n\n" +
		"The database: --database-url, else $DATABASE_URL, else the libpq variables (PGHOST, PGPORT, ...).\n" +
		"The schema: --schema, else $PGFENCE_SCHEMA, else pgfence.\n\ncommands:\n")
	for _, c := range commands {
		line := strings.TrimSpace(c.name + " " + c.synopsis)
		if len(line) <= 20 {
			fmt.Fprintf(&b, "  %-20s  %s\n", line, c.help)
		} else {
			fmt.Fprintf(&b, "  %s\n  %-20s  %s\n", line, "", c.help)
		}
	}
	b.WriteString(`
exit codes: 0 ok, 1 error, 2 usage, 3 no such lease, 4 no such job or shard,
5 the job's run failed (jobs run --wait), 75 lease held elsewhere,
76 lease lost while the command ran; run passes its command's code through.
`)
	return b.String()
}

func cmdVersion(_ context.Context, e *env, _ []string) error {
	fmt.Fprintln(e.stdout, version())
	return nil
}

func cmdHelp(_ context.Context, e *env, _ []string) error {
	fmt.Fprint(e.stdout, usageText())
	return nil
}
