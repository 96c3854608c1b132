// Command pgfence lets operators see and act on pgfence leases and run a
// command on exactly one machine at a time.
//
// Usage:
//
//	pgfence [global flags] COMMAND [flags] [args]
//
// Commands:
//
//	migrate up|status     apply or show pgfence's schema migrations
//	leases [--json]       list leases: name, holder, token, expires in, held for
//	release NAME [--yes] [--timeout 10s]
//	                      force-free a lease; its holder is fenced
//	run --lease NAME [--ttl 15s] [--wait] [--grace 10s] -- COMMAND [ARGS...]
//	                      run COMMAND while holding the lease, like flock(1) across hosts
//	jobs [--limit 20] [--job NAME] [--status S] [--json]
//	                      recent attempts from the runner's ledger
//	jobs status [JOB] [--json]
//	                      each job and shard: leader, token, last slot, next slot, missed, paused
//	jobs run JOB [--shard N] [--wait] [--timeout D]
//	                      run JOB once now on the replica that leads it (--wait: exit with its outcome)
//	jobs pause JOB        stop every replica starting JOB's scheduled slots
//	jobs resume JOB       let the replicas start JOB's scheduled slots again
//	jobs prune --older-than D
//	                      delete finished runs older than D (the latest slot of each job is kept)
//	groups [GROUP] [--json]
//	                      each consumer group's partitions: leader, token, offset, end, lag, when it last moved
//	groups seek GROUP PARTITION OFFSET [--yes] [--timeout 10s]
//	                      set a partition's committed offset, fenced: its leader's term is revoked
//	groups partitions GROUP N
//	                      change a consumer group's partition count (through a cut while replicas run it)
//	grant app|operator ROLE [--print]
//	                      give ROLE what an application (or this CLI) needs in the schema
//	ui [--listen 127.0.0.1:8080] [--host NAME] [--allow-actions] [--refresh 1s]
//	                      serve the status page (leases, jobs, fleet) in a browser
//	version               print the module version and the commit it was built from
//	help                  print this list
//
// Global flags (also accepted after the command name):
//
//	--database-url URL  the database (default $DATABASE_URL, else the libpq
//	                    variables PGHOST, PGPORT, ..., else localhost:5432)
//	--schema NAME       schema holding pgfence's tables (default $PGFENCE_SCHEMA, else
//	                    pgfence, the default of every pgfence entry point)
//
// Exit codes:
//
//	0   success
//	1   error (database unreachable, query failed, confirmation declined)
//	2   usage error (unknown command or flag, bad duration, missing command after --)
//	3   no such lease (release)
//	4   no such job or shard (jobs status, run, pause, resume), or consumer group (groups)
//	5   the run failed or panicked (jobs run --wait)
//	6   a job (or shard) listed has no leader (jobs status): it runs nowhere
//	75  the lease is held elsewhere (run without --wait)
//	76  the lease was lost while the command ran; the command was terminated
//	other: run passes its command's exit code through (128+N if killed by signal N)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/migrations"
)

// Exit codes; see the package documentation.
const (
	exitOK      = 0
	exitError   = 1
	exitUsage   = 2
	exitNoLease = 3
	exitNoJob   = 4 // no such job or shard (jobs status, run, pause, resume)
	// exitRunFailed: jobs run --wait saw the run fail or panic.
	exitRunFailed = 5
	// exitNoLeader: jobs status listed a job (or shard) without a leader.
	exitNoLeader = 6
	exitHeld     = 75
	exitLost     = 76
)

// exitError carries an exit code with a message for stderr.
type cliError struct {
	code int
	err  error
}

func (e *cliError) Error() string { return e.err.Error() }

func fail(code int, format string, a ...any) error {
	return &cliError{code, fmt.Errorf(format, a...)}
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

// closePool closes pool, waiting wait.PastDeadline at most: pgx takes up
// to 15 s to close a connection a partition cut (its cancel request to the
// server gets no answer), and the command is ending anyway; what is left
// closes in the background, or with the process.
func closePool(pool *pgxpool.Pool) {
	done := make(chan struct{})
	go func() {
		pool.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(wait.PastDeadline):
	}
}

// env is what every command needs.
type env struct {
	dbURL  string
	schema string
	target string // the database, user and address connected to, once known
	stdin  io.Reader
	stdout io.Writer
	stderr io.Writer
}

// into is a string flag that keeps the value already set (the global flags
// are accepted again after the command) and shows no default, so a URL with
// a password is never printed by usage.
type into struct{ p *string }

func (f into) String() string     { return "" }
func (f into) Set(s string) error { *f.p = s; return nil }

func (e *env) flags(fs *flag.FlagSet) {
	fs.Var(into{&e.dbURL}, "database-url", "database `URL` (default $DATABASE_URL, else the libpq variables)")
	fs.Var(into{&e.schema}, "schema", "`schema` holding pgfence's tables (default $PGFENCE_SCHEMA, else pgfence)")
}

// schemaName is the schema the command works in.
func (e *env) schemaName() string { return ident.Schema(e.schema) }

func (e *env) connect(ctx context.Context) (*pgxpool.Pool, error) {
	if err := ident.ValidateSchema(e.schema); err != nil {
		return nil, fail(exitUsage, "--schema: %v", err)
	}
	e.schema = ident.Schema(e.schema)
	url := e.dbURL
	if url == "" {
		url = os.Getenv("DATABASE_URL")
	}
	if url == "" && !libpqNamesADatabase() {
		return nil, fail(exitUsage, "no database named: set DATABASE_URL or --database-url, e.g.\n"+
			"  DATABASE_URL='postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable'\n"+
			"(or the libpq variables PGHOST, PGDATABASE, ...); pgfence does not guess one")
	}
	if scheme, _, ok := strings.Cut(url, "://"); ok && scheme != "postgres" && scheme != "postgresql" && !strings.ContainsAny(scheme, " =") {
		return nil, fail(exitUsage, "--database-url: scheme %q: a URL starts with postgres:// or postgresql:// "+
			"(or give keyword/value settings: host=... dbname=...)", scheme)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fail(exitUsage, "--database-url: %v", err)
	}
	cc := cfg.ConnConfig
	e.target = fmt.Sprintf("database %q as user %q at %s", cc.Database, cc.User, net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))))
	if cfg.ConnConfig.ConnectTimeout == 0 { // the URL's connect_timeout wins
		cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = "pgfence-cli"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			closePool(pool)
		}
		return nil, fail(exitError, "cannot reach %s: %s", e.target, distinctLines(err.Error()))
	}
	return pool, nil
}

// libpqNamesADatabase reports whether libpq's environment names a server or
// a database (an empty URL then means "the libpq variables", as in psql).
// With none of them, an empty URL would mean a local socket and a database
// named after the OS user: a guess the CLI refuses to make for commands that
// migrate, release and pause.
func libpqNamesADatabase() bool {
	for _, v := range []string{"PGHOST", "PGHOSTADDR", "PGDATABASE", "PGSERVICE"} {
		if os.Getenv(v) != "" {
			return true
		}
	}
	return false
}

// distinctLines drops the lines of s that repeat an earlier one: pgx names
// each connection attempt, and with sslmode=prefer it makes two per host
// (TLS, then plain) that fail alike.
func distinctLines(s string) string {
	seen := map[string]bool{}
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if !seen[l] {
			seen[l] = true
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	e := &env{stdin: stdin, stdout: stdout, stderr: stderr, schema: os.Getenv("PGFENCE_SCHEMA")}
	global := flag.NewFlagSet("pgfence", flag.ContinueOnError)
	global.SetOutput(stderr)
	global.Usage = func() { fmt.Fprint(stderr, usageText()) }
	e.flags(global)
	if err := global.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		return exitUsage
	}
	if global.NArg() == 0 {
		fmt.Fprint(stderr, usageText())
		return exitUsage
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal ends the command's context; one that comes once
	// the command has had wait.PastDeadline to tidy up (cancel a
	// statement at the server, which closing the connection would not)
	// ends the process, as if pgfence did not catch signals.
	context.AfterFunc(ctx, func() { time.AfterFunc(wait.PastDeadline, stop) })
	c, rest, ok := lookup(global.Args())
	if !ok {
		fmt.Fprintf(stderr, "pgfence: unknown command %q\n\n%s", global.Arg(0), usageText())
		return exitUsage
	}
	err := c.run(ctx, e, rest)
	if err == nil {
		return exitOK
	}
	if e.target != "" && fromDatabase(err) {
		err = fmt.Errorf("%w\n(connected to %s)", err, e.target)
	}
	var ce *cliError
	if errors.As(err, &ce) {
		if ce.err.Error() != "" {
			fmt.Fprintln(stderr, "pgfence:", ce.err)
		}
		return ce.code
	}
	fmt.Fprintln(stderr, "pgfence:", err)
	return exitError
}

// fromDatabase reports whether err is the database's answer (an error the
// server raised, or a schema found not migrated), which depends on the
// database and role connected to.
func fromDatabase(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) || errors.Is(err, migrations.ErrNotMigrated)
}

// parse parses command name's flags, with the global ones accepted too.
func parse(e *env, name string, args []string, setup func(fs *flag.FlagSet)) (*flag.FlagSet, error) {
	synopsis := synopsisOf(name)
	if subs := subcommands(name); subs != "" {
		synopsis += " | " + strings.ReplaceAll(subs, ", ", " | ")
	}
	fs := flag.NewFlagSet("pgfence "+name, flag.ContinueOnError)
	fs.SetOutput(e.stderr)
	fs.Usage = func() {
		fmt.Fprintf(e.stderr, "usage: pgfence %s %s\n", name, synopsis)
		fs.PrintDefaults()
	}
	e.flags(fs)
	if setup != nil {
		setup(fs)
	}
	// Flags may come before or after positional arguments ("release NAME
	// --yes"); everything after "--" is positional.
	var positional []string
	rest := args
	for {
		if err := fs.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, &cliError{exitOK, errors.New("")}
			}
			return nil, &cliError{exitUsage, errors.New("")}
		}
		consumed := len(rest) - fs.NArg()
		if fs.NArg() == 0 || (consumed > 0 && rest[consumed-1] == "--") {
			positional = append(positional, fs.Args()...)
			break
		}
		positional = append(positional, fs.Arg(0))
		rest = fs.Args()[1:]
	}
	_ = fs.Parse(append([]string{"--"}, positional...)) // leave fs.Args() = positional
	return fs, nil
}
