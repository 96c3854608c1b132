package faultproxy

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/pgtest"
)

const (
	// giveUp is how long a client waits for its COMMIT's reply (HoldReply and
	// HalfOpen never deliver one).
	giveUp = 2 * time.Second
	// lateBy is LateCommit's delay in these tests.
	lateBy = 2 * time.Second
	// settle bounds every wait for the server to reach a state.
	settle = 10 * time.Second
)

// fixture is a test's table, an admin pool that reads it directly, and
// connections through proxies.
type fixture struct {
	admin *pgxpool.Pool
	table string
	app   string // application_name of the connections through proxies
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	admin := pgtest.NewPool(t, "faultproxy-admin")
	schema := pgtest.Schema(t, "faultproxy")
	f := &fixture{admin: admin, table: pgx.Identifier{schema, "t"}.Sanitize(), app: pgtest.UniqueName("faultproxy")}
	ctx := pgtest.Context(t, settle)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "CREATE TABLE "+f.table+" (id text PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	// A backend a failed test left in its transaction would block dropping
	// the schema.
	t.Cleanup(func() { pgtest.Terminate(t, admin, f.app) })
	return f
}

// connect opens a pgx connection through a new proxy on which every COMMIT
// meets fault (LateCommit: after delay). Both are closed when the test ends.
func (f *fixture) connect(t *testing.T, fault CommitFault, delay time.Duration) (*Proxy, *pgx.Conn) {
	t.Helper()
	cfg, err := pgx.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	p, err := To(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	p.OnCommit(func() (CommitFault, time.Duration) { return fault, delay })
	p.Route(&cfg.Config)
	cfg.TLSConfig = nil // the proxy reads only unencrypted connections
	cfg.RuntimeParams["application_name"] = f.app
	conn, err := pgx.ConnectConfig(pgtest.Context(t, settle), cfg)
	if err != nil {
		_ = p.Close()
		t.Fatalf("connect through the proxy: %v", err)
	}
	t.Cleanup(func() {
		// The proxy first: a pgx connection that gave up waits (up to 15s)
		// for the server side to close, which HoldReply and HalfOpen never do.
		_ = p.Close()
		_ = conn.Close(context.Background())
		<-conn.PgConn().CleanupDone()
	})
	return p, conn
}

func (f *fixture) present(t *testing.T, id string) bool {
	t.Helper()
	var n int
	if err := f.admin.QueryRow(pgtest.Context(t, settle), "SELECT count(*) FROM "+f.table+" WHERE id = $1", id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// state returns the backend's state in pg_stat_activity ("" once it is gone).
func (f *fixture) state(t *testing.T, pid uint32) string {
	t.Helper()
	var s *string
	err := f.admin.QueryRow(pgtest.Context(t, settle), "SELECT state FROM pg_stat_activity WHERE pid = $1", pid).Scan(&s)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return ""
	case err != nil:
		t.Fatal(err)
	case s == nil:
		return "?"
	}
	return *s
}

// describe tells what a client sees: the error, the types it wraps, and
// what pgconn's classifiers make of it.
func describe(err error) string {
	if err == nil {
		return "no error"
	}
	var types []string
	for e := err; e != nil; e = errors.Unwrap(e) {
		types = append(types, fmt.Sprintf("%T", e))
	}
	return fmt.Sprintf("%q (%s), SafeToRetry=%v, Timeout=%v",
		err, strings.Join(types, " > "), pgconn.SafeToRetry(err), pgconn.Timeout(err))
}

// Each fault at the COMMIT of a pgx transaction (tx.Commit sends a simple
// Query "commit"): what the client sees, and what the server has once the
// dust settles.
func TestCommitFaultsPgx(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	for _, tc := range []struct {
		fault CommitFault
		delay time.Duration
		// settled checks the server once Commit has returned err, after
		// start; it returns whether the row is there.
		settled func(t *testing.T, f *fixture, id string, pid uint32, start time.Time) bool
	}{
		{CommitPass, 0, func(t *testing.T, f *fixture, id string, _ uint32, _ time.Time) bool {
			return f.present(t, id)
		}},
		{ResetAfterCommit, 0, func(t *testing.T, f *fixture, id string, pid uint32, _ time.Time) bool {
			pgtest.Eventually(t, settle, "the backend to end", func() bool { return f.state(t, pid) == "" })
			return f.present(t, id) // either: the server raced the close
		}},
		{ResetAfterReply, 0, func(t *testing.T, f *fixture, id string, _ uint32, _ time.Time) bool {
			return f.present(t, id) // the proxy had the server's reply before it reset the client
		}},
		{ResetBeforeCommit, 0, func(t *testing.T, f *fixture, id string, pid uint32, _ time.Time) bool {
			pgtest.Eventually(t, settle, "the backend to end", func() bool { return f.state(t, pid) == "" })
			return f.present(t, id)
		}},
		{LateCommit, lateBy, func(t *testing.T, f *fixture, id string, pid uint32, start time.Time) bool {
			if f.present(t, id) && time.Since(start) < lateBy {
				t.Fatalf("committed before the delay (%v) was over", lateBy)
			}
			pgtest.Eventually(t, lateBy+settle, "the late COMMIT", func() bool { return f.present(t, id) })
			t.Logf("LateCommit: committed %v after Commit was called", time.Since(start).Round(time.Millisecond))
			pgtest.Eventually(t, settle, "the backend to end", func() bool { return f.state(t, pid) == "" })
			return true
		}},
		{HoldReply, 0, func(t *testing.T, f *fixture, id string, _ uint32, _ time.Time) bool {
			pgtest.Eventually(t, settle, "the held COMMIT", func() bool { return f.present(t, id) })
			return true
		}},
		{HalfOpen, 0, func(t *testing.T, f *fixture, id string, pid uint32, _ time.Time) bool {
			pgtest.Eventually(t, settle, "the backend idle in transaction", func() bool {
				return f.state(t, pid) == "idle in transaction"
			})
			if f.present(t, id) {
				t.Fatal("committed, though the COMMIT was not forwarded")
			}
			if _, err := f.admin.Exec(pgtest.Context(t, settle), "SELECT pg_terminate_backend($1)", pid); err != nil {
				t.Fatal(err)
			}
			pgtest.Eventually(t, settle, "the backend to end", func() bool { return f.state(t, pid) == "" })
			return f.present(t, id)
		}},
	} {
		t.Run(tc.fault.String(), func(t *testing.T) {
			t.Parallel()
			p, conn := f.connect(t, tc.fault, tc.delay)
			ctx := pgtest.Context(t, settle)
			id := pgtest.UniqueName(tc.fault.String())
			pid := conn.PgConn().PID()
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO "+f.table+" (id) VALUES ($1)", id); err != nil {
				t.Fatal(err)
			}
			start := time.Now() // before the deadline is set: Commit cannot give up before start+giveUp
			cctx, cancel := context.WithTimeout(ctx, giveUp)
			err = tx.Commit(cctx)
			took := time.Since(start)
			cancel()
			t.Logf("%v: Commit returned after %v: %s", tc.fault, took.Round(time.Millisecond), describe(err))
			switch gaveUp := took >= giveUp; {
			case tc.fault == CommitPass && err != nil:
				t.Fatalf("Commit: %v", err)
			case tc.fault != CommitPass && err == nil:
				t.Fatal("Commit succeeded through the fault")
			case (tc.fault == HoldReply || tc.fault == HalfOpen) != gaveUp:
				t.Errorf("Commit returned after %v (it gives up after %v)", took, giveUp)
			}
			present := tc.settled(t, f, id, pid, start)
			want := map[CommitFault]string{CommitPass: "present", ResetAfterReply: "present",
				ResetBeforeCommit: "absent", LateCommit: "present", HoldReply: "present", HalfOpen: "absent"}[tc.fault]
			got := map[bool]string{true: "present", false: "absent"}[present]
			t.Logf("%v: row %s", tc.fault, got)
			if want != "" && got != want {
				t.Errorf("%v: the row is %s, want %s", tc.fault, got, want)
			}
			if n := p.Commits(); n[tc.fault] != 1 || len(n) != 1 {
				t.Errorf("Commits() = %v, want one %v", n, tc.fault)
			}
		})
	}
}

// A COMMIT sent through the extended protocol, with the unnamed statement
// (pgconn.ExecParams) or a named one prepared earlier (ExecPrepared), is
// found at its Execute.
func TestCommitFaultsExtended(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ways := map[string]func(ctx context.Context, c *pgconn.PgConn) error{
		"unnamed": func(ctx context.Context, c *pgconn.PgConn) error {
			return c.ExecParams(ctx, "COMMIT", nil, nil, nil, nil).Read().Err
		},
		"prepared": func(ctx context.Context, c *pgconn.PgConn) error {
			return c.ExecPrepared(ctx, "finish", nil, nil, nil).Read().Err
		},
	}
	for way, commit := range ways {
		for _, tc := range []struct {
			fault CommitFault
			delay time.Duration
			want  string // "present", "absent" or "" (either)
		}{
			{CommitPass, 0, "present"},
			{ResetBeforeCommit, 0, "absent"},
			// The Execute is forwarded, its Sync is not: the server
			// commits anyway, unless it sees the close first.
			{ResetAfterCommit, 0, ""},
			{ResetAfterReply, 0, "present"},
			{LateCommit, time.Second, "present"},
		} {
			t.Run(way+"/"+tc.fault.String(), func(t *testing.T) {
				t.Parallel()
				p, conn := f.connect(t, tc.fault, tc.delay)
				ctx := pgtest.Context(t, settle)
				if _, err := conn.PgConn().Prepare(ctx, "finish", "commit;", nil); err != nil {
					t.Fatal(err)
				}
				id := pgtest.UniqueName(tc.fault.String())
				pid := conn.PgConn().PID()
				if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
					t.Fatal(err)
				}
				if _, err := conn.Exec(ctx, "INSERT INTO "+f.table+" (id) VALUES ($1)", id); err != nil {
					t.Fatal(err)
				}
				err := commit(ctx, conn.PgConn())
				t.Logf("%s %v: %s", way, tc.fault, describe(err))
				if (err == nil) != (tc.fault == CommitPass) {
					t.Fatalf("COMMIT returned %v", err)
				}
				if tc.fault != CommitPass {
					// LateCommit: well before lateReplyWait, so the server
					// replied to the COMMIT it was sent late (with a Sync).
					pgtest.Eventually(t, tc.delay+lateReplyWait/2, "the backend to end", func() bool { return f.state(t, pid) == "" })
				}
				got := map[bool]string{true: "present", false: "absent"}[f.present(t, id)]
				t.Logf("%s %v: row %s", way, tc.fault, got)
				if tc.want != "" && got != tc.want {
					t.Errorf("the row is %s, want %s", got, tc.want)
				}
				if n := p.Commits(); n[tc.fault] != 1 || len(n) != 1 {
					t.Errorf("Commits() = %v, want one %v", n, tc.fault)
				}
			})
		}
	}
}
