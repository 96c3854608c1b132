// Package pgtest is pgfence's test harness: every test gets its own schema
// with the migrations applied, on a real PostgreSQL server: the one
// TEST_DATABASE_URL names or, without it, a throwaway one internal/devdb
// starts for the package's tests (a private server from the machine's
// PostgreSQL binaries, or a container where Docker is available).
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/pgfence/pgfence/internal/devdb"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/pgfencetest"
)

// EnvURL names the environment variable that points the tests at a server.
const EnvURL = "TEST_DATABASE_URL"

var (
	baseURL string
	noDB    error // why there is no database, once Main has looked
)

// Main finds the database, runs the package's tests and checks that no
// goroutine outlives them. Call it from TestMain. Without a database, the
// tests that need none (pure logic: schedules, assignment, validation) still
// run and pass, and every test that needs one fails with a message that says
// how to provide one; none is skipped.
func Main(m *testing.M) {
	os.Exit(run(m))
}

// minParallel is how many parallel tests a package runs at once unless
// -parallel says otherwise: the tests mostly wait (on the database, on
// leases expiring in real time), so GOMAXPROCS (2 on a small CI machine)
// would leave the machine idle.
const minParallel = 4

func run(m *testing.M) int {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set && runtime.GOMAXPROCS(0) < minParallel {
		_ = flag.Set("test.parallel", strconv.Itoa(minParallel))
	}
	stop := func() {}
	if u := os.Getenv(EnvURL); u != "" {
		baseURL = u
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		srv, err := devdb.Start(ctx, devdb.Options{Trust: true}) // the tests log in as roles they create
		cancel()
		if err != nil {
			noDB = fmt.Errorf("pgfence tests need PostgreSQL: set %s (for example\n"+
				"  %s='postgres://postgres@127.0.0.1:5432/test?sslmode=disable'),\n"+
				"install PostgreSQL's server binaries (Debian: apt-get install postgresql; or set %s),\n"+
				"or make a Docker engine available for testcontainers.\n(%v)", EnvURL, EnvURL, devdb.EnvBinDir, err)
		} else {
			stop = func() { _ = srv.Close() }
			fmt.Fprintf(os.Stderr, "pgtest: no %s: the tests use %s (PostgreSQL %s), removed when they end\n", EnvURL, srv.How, srv.Version)
			baseURL = srv.URL
			_ = os.Setenv(EnvURL, srv.URL) // for the test binary's child processes
		}
	}
	if noDB == nil {
		if err := checkServer(baseURL); err != nil {
			fmt.Fprintln(os.Stderr, "pgtest:", err)
			stop()
			return 1
		}
	}
	code := m.Run()
	stop() // before looking for goroutines left: the server's reader is one
	if code == 0 {
		if err := goleak.Find(IgnoreLeaks()...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			return 1
		}
	}
	return code
}

// EnvMajor and EnvExecMode name environment variables with which a run
// states what it tests (CI's runs on each major version, and without
// prepared statements): the tests then fail at once if the server's major
// version or the URL's default_query_exec_mode is another, rather than
// passing on what the run did not mean to test.
const (
	EnvMajor    = "PGFENCE_TEST_SERVER_MAJOR"
	EnvExecMode = "PGFENCE_TEST_EXEC_MODE"
)

// checkServer checks the server and URL against EnvMajor and EnvExecMode.
func checkServer(u string) error {
	want := os.Getenv(EnvMajor)
	mode := os.Getenv(EnvExecMode)
	if want == "" && mode == "" {
		return nil
	}
	cfg, err := pgx.ParseConfig(u)
	if err != nil {
		return err
	}
	if mode != "" && cfg.DefaultQueryExecMode.String() != strings.ReplaceAll(mode, "_", " ") {
		return fmt.Errorf("%s=%s but the URL's query exec mode is %s (set default_query_exec_mode=%s in %s)",
			EnvExecMode, mode, cfg.DefaultQueryExecMode, mode, EnvURL)
	}
	if want == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var num int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&num); err != nil {
		return err
	}
	if got := strconv.Itoa(num / 10000); got != want {
		return fmt.Errorf("%s=%s but the server is PostgreSQL %s (%d)", EnvMajor, want, got, num)
	}
	fmt.Fprintf(os.Stderr, "pgtest: PostgreSQL %d\n", num)
	return nil
}

// IgnoreLeaks lists goroutines that belong to the test infrastructure
// (none: a throwaway server lives in another process, and its reader
// ends before the check).
func IgnoreLeaks() []goleak.Option { return nil }

// URL returns the server URL the package's tests use.
func URL(tb testing.TB) string {
	tb.Helper()
	switch {
	case noDB != nil:
		tb.Fatal(noDB)
	case baseURL == "":
		tb.Fatalf("pgtest: no database: call pgtest.Main from TestMain")
	}
	return baseURL
}

// DB is one test's isolated database area: pgfencetest's (a fresh migrated
// schema on a pool of the test server), and the server's URL.
type DB struct {
	*pgfencetest.DB
	// URL is the server URL.
	URL string
}

// New creates a fresh schema, applies the migrations in it and returns it
// with a pool whose search_path is left alone (code under test must be
// given Schema). The schema and pool are removed when the test ends.
func New(tb testing.TB) *DB {
	tb.Helper()
	url := URL(tb)
	return &DB{DB: pgfencetest.NewIn(tb, NewPool(tb, "pgfence-test")), URL: url}
}

// Database creates an empty database of its own on the test server, for
// tests of what happens with no schema named (pgfence's default schema), and
// returns its URL; it is dropped, with any connections left, when the test
// ends. The test server's role needs CREATEDB.
func Database(tb testing.TB) string {
	tb.Helper()
	name := "pgfence_test_" + strings.ToLower(randHex(6))
	admin := NewPool(tb, "pgtest-database")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		tb.Fatalf("pgtest: create database %s: %v", name, err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			tb.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})
	base := URL(tb)
	if u, err := url.Parse(base); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + name
		return u.String()
	}
	return base + " dbname=" + name // keyword/value form: the last dbname wins
}

// NewPool opens a pool to the test server whose connections carry
// application_name, so a test can find (and kill) exactly its own backends.
// It is closed when the test ends.
func NewPool(tb testing.TB, appName string, opts ...func(*pgxpool.Config)) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(URL(tb))
	if err != nil {
		tb.Fatalf("pgtest: parse %s: %v", EnvURL, err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	for _, o := range opts {
		o(cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("pgtest: connect: %v", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		tb.Fatalf("pgtest: ping %s: %v", EnvURL, err)
	}
	tb.Cleanup(func() { closePool(tb, pool, appName) })
	return pool
}

// closePool closes pool, which waits for every connection checked out of
// it; if some are still out after 30 s (a transaction a failed test left
// open, say), it says so and leaves the pool to close on its own, instead
// of holding the test up until the package's timeout.
func closePool(tb testing.TB, pool *pgxpool.Pool, appName string) {
	closed := make(chan struct{})
	go func() { pool.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		tb.Errorf("pgtest: pool %s: %d connections still checked out 30 s after the test ended (a transaction left open?)",
			appName, pool.Stat().AcquiredConns())
	}
}

// UniqueName returns a random application or lease name with a prefix.
func UniqueName(prefix string) string { return prefix + "-" + randHex(6) }

// Terminate kills every backend whose application_name is appName, from an
// admin connection, waits until they have exited (their clients have been
// sent the FATAL message by then), and returns how many it killed.
func Terminate(tb testing.TB, admin *pgxpool.Pool, appName string) int {
	tb.Helper()
	ctx := context.Background()
	rows, err := admin.Query(ctx, `SELECT pid FROM (SELECT pid, pg_terminate_backend(pid) AS killed FROM pg_stat_activity
		  WHERE application_name = $1 AND pid <> pg_backend_pid()) k WHERE killed`, appName)
	var pids []int32
	if err == nil {
		pids, err = pgx.CollectRows(rows, pgx.RowTo[int32])
	}
	if err != nil {
		tb.Fatalf("pgtest: terminate %s: %v", appName, err)
	}
	Eventually(tb, 30*time.Second, "the terminated backends of "+appName+" to exit", func() bool {
		var left int
		err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)", pids).Scan(&left)
		return err == nil && left == 0
	})
	return len(pids)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Build compiles the main package in dir (relative to the test's working
// directory) and returns the binary's path, removed when the test ends.
func Build(tb testing.TB, dir string) string {
	tb.Helper()
	bin := filepath.Join(tb.TempDir(), filepath.Base(dir)+".bin")
	if out, err := exec.Command("go", "build", "-o", bin, dir).CombinedOutput(); err != nil {
		tb.Fatalf("go build %s: %v\n%s", dir, err, out)
	}
	return bin
}

// Schema returns a fresh, valid, unused schema name with a prefix (not
// created), dropped with CASCADE when the test ends.
func Schema(tb testing.TB, prefix string) string {
	tb.Helper()
	s := prefix + "_" + randHex(6)
	pool := NewPool(tb, "pgtest-schema")
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{s}.Sanitize()+" CASCADE")
	})
	return s
}

// Quiet is a logger that discards everything, for clients under test.
var Quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// Context returns a context that ends after d or when the test ends.
func Context(tb testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	tb.Cleanup(cancel)
	return ctx
}

// Client returns a lock client on the test's schema (cfg.Schema and a
// cfg.Logger, which keeps the records and writes them to the test's log if
// it fails, are filled in), closed when the test ends.
func (db *DB) Client(tb testing.TB, cfg lock.Config) *lock.Client {
	tb.Helper()
	if cfg.Schema == "" {
		cfg.Schema = db.Schema
	}
	if cfg.Logger == nil {
		// Kept, and written to the test's log if it fails.
		logs := NewLogs()
		logs.LogOnFailure(tb)
		cfg.Logger = slog.New(logs)
	}
	c, err := lock.New(db.Pool, cfg)
	if err != nil {
		tb.Fatalf("lock.New: %v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = c.Close(ctx)
	})
	return c
}

// Logs is a slog.Handler that keeps every record (with the attributes of
// loggers derived through With), for tests that check what was logged.
type Logs struct {
	mu    *sync.Mutex
	recs  *[]slog.Record
	attrs []slog.Attr
}

// NewLogs returns an empty recorder; use it as slog.New(logs).
func NewLogs() *Logs { return &Logs{mu: &sync.Mutex{}, recs: &[]slog.Record{}} }

// Enabled implements slog.Handler: every level is kept.
func (l *Logs) Enabled(context.Context, slog.Level) bool { return true }

// Handle implements slog.Handler.
func (l *Logs) Handle(_ context.Context, r slog.Record) error {
	r = r.Clone()
	r.AddAttrs(l.attrs...)
	l.mu.Lock()
	defer l.mu.Unlock()
	*l.recs = append(*l.recs, r)
	return nil
}

// WithAttrs implements slog.Handler.
func (l *Logs) WithAttrs(as []slog.Attr) slog.Handler {
	return &Logs{mu: l.mu, recs: l.recs, attrs: append(append([]slog.Attr(nil), l.attrs...), as...)}
}

// WithGroup implements slog.Handler (groups are not kept apart).
func (l *Logs) WithGroup(string) slog.Handler { return l }

// Find returns the records at level whose message contains msg.
func (l *Logs) Find(level slog.Level, msg string) []slog.Record {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []slog.Record
	for _, r := range *l.recs {
		if r.Level == level && strings.Contains(r.Message, msg) {
			out = append(out, r)
		}
	}
	return out
}

// LogOnFailure writes every kept record to the test's log when the test
// has failed, so that a failure shows what the clients logged up to it.
func (l *Logs) LogOnFailure(tb testing.TB) {
	tb.Cleanup(func() {
		if !tb.Failed() {
			return
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, r := range *l.recs {
			var b strings.Builder
			fmt.Fprintf(&b, "%s %s %s", r.Time.Format("15:04:05.000"), r.Level, r.Message)
			r.Attrs(func(a slog.Attr) bool {
				fmt.Fprintf(&b, " %s", a)
				return true
			})
			tb.Log(b.String())
		}
	})
}

// NeedTool handles a test's missing external tool (PgBouncer, Patroni, the
// server binaries): if err matches one of missing, the test is skipped with
// err's message, which names the tool and how to install it, or fails when
// CI=true, so CI always runs everything. Other errors are left to the caller.
func NeedTool(tb testing.TB, err error, missing ...error) {
	tb.Helper()
	for _, m := range missing {
		if err != nil && errors.Is(err, m) {
			if os.Getenv("CI") == "true" {
				tb.Fatalf("%v (CI=true: a missing tool fails the run)", err)
			}
			tb.Skipf("skipped: %v", err)
		}
	}
}

// Eventually polls cond every 10ms until it holds, and fails the test,
// naming what it waited for, if d passes first: the one polling loop of the
// tests that wait for something in real time.
func Eventually(tb testing.TB, d time.Duration, what string, cond func() bool) {
	tb.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			tb.Fatalf("timed out after %v waiting for %s", d, what)
		}
	}
}

// NoPanic runs f and returns its error, or its panic as an error, so that a
// table test reports a row that panics and goes on with the next.
func NoPanic(f func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return f()
}
