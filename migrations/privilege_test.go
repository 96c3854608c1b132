package migrations_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

// An application role with exactly the documented grants
// (migrations.GrantApp) can do everything pgfence does, and the schema
// refuses what it promises to refuse, naming what refused it. Formerly, a
// role without SELECT on the token sequence could not acquire a new name
// (42501 from the insert trigger), an INSERT reusing an issued token was
// accepted, and the latest run of a job could be deleted (its slot would run
// again).
func TestLeastPrivilege(t *testing.T) {
	ctx := pgtest.Context(t, 2*time.Minute)
	owner := pgtest.NewPool(t, "privilege-owner")
	schema := pgtest.Schema(t, "priv")
	if _, err := migrations.Up(ctx, owner, schema); err != nil {
		t.Fatal(err)
	}
	role := "pgfence_app_" + strings.ToLower(pgtest.UniqueName("r")[2:])
	data := ident.Table(schema, "charges")
	for _, sql := range []string{
		"CREATE ROLE " + role + " LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE",
		"CREATE TABLE " + data + " (customer text, token bigint)",
		"GRANT SELECT, INSERT ON " + data + " TO " + role,
	} {
		if _, err := owner.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = owner.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		_, _ = owner.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role)
	})
	if err := migrations.GrantApp(ctx, owner, schema, role); err != nil {
		t.Fatal(err)
	}
	app := pgtest.NewPool(t, "privilege-app", func(c *pgxpool.Config) { c.ConnConfig.User = role })

	// Everything the library does, as the application role.
	if v, err := migrations.Up(ctx, app, schema); err != nil || v != migrations.Latest {
		t.Fatalf("Up with nothing to do, as the application role: %d, %v", v, err)
	}
	lc, err := lock.New(app, lock.Config{Schema: schema, TTL: 3 * time.Second, RenewInterval: 200 * time.Millisecond, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close(ctx)
	l, err := lc.Acquire(ctx, "billing") // a new name: the insert path
	if err != nil {
		t.Fatalf("Acquire as the application role: %v", err)
	}
	renewals := lc.Stats().Renewals
	pgtest.Eventually(t, 30*time.Second, "two renewals as the application role", func() bool {
		return lc.Stats().Renewals-renewals >= 2 || l.Err() != nil
	})
	if err := l.Check(ctx); err != nil {
		t.Fatalf("renewed lease: %v", err)
	}
	err = l.RunTx(ctx, func(tx pgx.Tx) error {
		if err := (fence.Resource{Name: "ledger", Schema: schema}).Admit(ctx, tx, l.Token()); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+data+" VALUES ('c1', $1)", int64(l.Token()))
		return err
	})
	if err != nil {
		t.Fatalf("guarded write with a resource fence: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := lock.ForceRelease(ctx, lc.Pool(), lc.Config().Schema, "billing"); err != nil {
		t.Fatalf("ForceRelease: %v", err)
	}
	rc, err := lock.New(app, lock.Config{Schema: schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close(ctx)
	r, err := runner.New(rc, runner.Config{RebalanceInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan struct{}, 1)
	job := runner.Job{Name: "nightly", Schedule: "@every 100ms", Run: func(ctx context.Context, run *runner.Run) error {
		err := run.CommitTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+data+" VALUES ('job', $1)", int64(run.Token))
			return err
		})
		if err == nil {
			select {
			case ran <- struct{}{}:
			default:
			}
		}
		return err
	}}
	if err := r.RegisterSharded(job, 2); err != nil {
		t.Fatal(err)
	}
	// And a consumer group, whose partition commits its offset once.
	advanced := make(chan struct{})
	if err := r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 1, Consume: func(ctx context.Context, p *runner.Partition) error {
		if p.Offset() == 0 {
			if err := p.Commit(ctx, func(context.Context, pgx.Tx) (int64, error) { return 1, nil }); err != nil {
				return err
			}
			close(advanced)
		}
		return p.Wait(ctx)
	}}); err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	select {
	case <-ran:
	case err := <-done:
		t.Fatalf("runner as the application role: %v", err)
	case <-ctx.Done():
		t.Fatal("no run succeeded as the application role")
	}
	select {
	case <-advanced:
	case err := <-done:
		t.Fatalf("runner as the application role: %v", err)
	case <-ctx.Done():
		t.Fatal("no partition position committed as the application role")
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("runner: %v", err)
	}
	if runs, err := runner.Runs(ctx, app, schema, runner.RunFilter{}); err != nil || len(runs) == 0 {
		t.Fatalf("Runs: %d, %v", len(runs), err)
	}
	if _, err := runner.Prune(ctx, app, schema, time.Now()); err != nil {
		t.Fatalf("Prune: %v", err)
	}

	// What the application role must not be able to do, and what refuses it.
	leases, runs, fences := ident.Table(schema, "pgfence_leases"), ident.Table(schema, "pgfence_runs"), ident.Table(schema, "pgfence_fences")
	offsets := ident.Table(schema, "pgfence_offsets")
	forbidden := []struct {
		action, sql, code, refusedBy string
	}{
		{"delete a lease row (tokens would restart)", "DELETE FROM " + leases, "42501", "no DELETE privilege (the owner: trigger pgfence_leases_protect_delete)"},
		{"truncate the leases", "TRUNCATE " + leases, "42501", "no TRUNCATE privilege"},
		{"lower a token", "UPDATE " + leases + " SET token = token - 1", "428C9", "identity column (GENERATED ALWAYS)"},
		{"insert a lease reusing an issued token", "INSERT INTO " + leases + " (name, token, acquired_at) OVERRIDING SYSTEM VALUE VALUES ('forged', 1, now())", "PF010", "trigger pgfence_leases_check_insert"},
		{"insert a lease with a future token", "INSERT INTO " + leases + " (name, token, acquired_at) OVERRIDING SYSTEM VALUE VALUES ('forged', 1000000, now())", "PF010", "trigger pgfence_leases_check_insert"},
		{"lower a resource fence's mark", "UPDATE " + fences + " SET token = token - 1", "PF010", "trigger pgfence_fences_protect_update"},
		{"delete a resource fence", "DELETE FROM " + fences, "42501", "no DELETE privilege"},
		{"delete the latest run of a job (its slot would run again)", "DELETE FROM " + runs, "PF010", "trigger pgfence_runs_protect_delete"},
		{"turn a succeeded run into another state", "UPDATE " + runs + " SET status = 'failed' WHERE status = 'succeeded'", "PF010", "trigger pgfence_runs_protect"},
		{"truncate the ledger", "TRUNCATE " + runs, "42501", "no TRUNCATE privilege"},
		{"insert an offset with a token of its choosing", "INSERT INTO " + offsets + " (group_name, partition, token) VALUES ('forged', 0, 1000000)", "42501", "INSERT on (group_name, partition) only"},
		{"move an offset to another partition", "UPDATE " + offsets + " SET partition = partition + 1", "42501", "no UPDATE on the key"},
		{"lower an offset's token", "UPDATE " + offsets + " SET token = token - 1", "PF010", "trigger pgfence_offsets_protect"},
		{"drop the leases table", "DROP TABLE " + leases, "42501", "not the owner"},
		{"change the leases table", "ALTER TABLE " + leases + " SET (fillfactor = 100)", "42501", "not the owner"},
		{"create objects in the schema", "CREATE TABLE " + ident.Table(schema, "intruder") + " (x int)", "42501", "no CREATE on the schema"},
	}
	for _, f := range forbidden {
		_, err := app.Exec(ctx, f.sql)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != f.code {
			t.Errorf("%s: %v, want SQLSTATE %s (%s)", f.action, err, f.code, f.refusedBy)
			continue
		}
		t.Logf("refused: %-58s %s  %s", f.action, pg.Code, f.refusedBy)
	}

	// The operator role (the CLI) with exactly GrantOperator: it lists,
	// force-releases, reads and prunes the ledger, reads, pauses, resumes
	// and runs jobs, sees the migration status; it cannot acquire.
	opRole := role + "_op"
	if _, err := owner.Exec(ctx, "CREATE ROLE "+opRole+" LOGIN NOSUPERUSER"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = owner.Exec(context.Background(), "DROP OWNED BY "+opRole+"; DROP ROLE "+opRole) })
	if err := migrations.GrantOperator(ctx, owner, schema, opRole); err != nil {
		t.Fatal(err)
	}
	op := pgtest.NewPool(t, "privilege-operator", func(c *pgxpool.Config) { c.ConnConfig.User = opRole })
	oc, err := lock.New(op, lock.Config{Schema: schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer oc.Close(ctx)
	if infos, err := lock.Leases(ctx, oc.Pool(), oc.Config().Schema); err != nil || len(infos) == 0 {
		t.Fatalf("Leases as the operator: %d, %v", len(infos), err)
	}
	if _, err := lock.ForceRelease(ctx, oc.Pool(), oc.Config().Schema, "billing"); err != nil {
		t.Fatalf("ForceRelease as the operator: %v", err)
	}
	if _, err := runner.Runs(ctx, op, schema, runner.RunFilter{}); err != nil {
		t.Fatalf("Runs as the operator: %v", err)
	}
	if _, err := runner.Prune(ctx, op, schema, time.Now()); err != nil {
		t.Fatalf("Prune as the operator: %v", err)
	}
	// It steers the job the application's runner registered.
	if jobs, err := runner.Jobs(ctx, op, schema, "nightly"); err != nil || len(jobs) != 2 {
		t.Fatalf("Jobs as the operator: %+v, %v", jobs, err)
	}
	if err := runner.Pause(ctx, op, schema, "nightly", "operator"); err != nil {
		t.Fatalf("Pause as the operator: %v", err)
	}
	if err := runner.Resume(ctx, op, schema, "nightly"); err != nil {
		t.Fatalf("Resume as the operator: %v", err)
	}
	if refs, err := runner.RunNow(ctx, op, schema, "nightly", runner.AllShards, "operator"); err != nil || len(refs) != 2 {
		t.Fatalf("RunNow as the operator: %v, %v", refs, err)
	}
	if st, err := migrations.Status(ctx, op, schema); err != nil || st.Current != migrations.Latest {
		t.Fatalf("Status as the operator: %+v, %v", st, err)
	}
	// It seeks the group's partition (the partition has had its leader:
	// the application committed its offset).
	<-advanced
	if before, err := runner.Seek(ctx, op, schema, "relay", 0, 0, "operator"); err != nil || before != 1 {
		t.Fatalf("Seek as the operator: %d, %v; want 1 before", before, err)
	}
	if _, err := runner.Terms(ctx, op, schema, runner.TermFilter{Group: "relay"}); err != nil {
		t.Fatalf("Terms as the operator: %v", err)
	}
	var pg *pgconn.PgError
	if _, err := oc.TryAcquire(ctx, "operator-acquires"); !errors.As(err, &pg) || pg.Code != "42501" {
		t.Fatalf("TryAcquire as the operator: %v, want 42501", err)
	}
}

// A takeover by the application role ends the idle guarded transaction of a
// frozen holder of the same role, as it would in production. A holder whose
// sessions it may not end (here a superuser's) is waited for, and the
// client says why, once, with the grant that would let it.
func TestApplicationRoleEndsIdleHolders(t *testing.T) {
	ctx := pgtest.Context(t, time.Minute)
	owner := pgtest.NewPool(t, "idle-owner")
	schema := pgtest.Schema(t, "idle")
	if _, err := migrations.Up(ctx, owner, schema); err != nil {
		t.Fatal(err)
	}
	role := newRole(t, owner, "pgfence_idle")
	if err := migrations.GrantApp(ctx, owner, schema, role); err != nil {
		t.Fatal(err)
	}
	app := pgtest.NewPool(t, "idle-app", func(c *pgxpool.Config) { c.ConnConfig.User = role })
	var logged strings.Builder
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return logged.Write(p)
	}), nil))
	taker, err := lock.New(app, lock.Config{Schema: schema, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	defer taker.Close(ctx)
	expire := func(name string) {
		t.Helper()
		if _, err := owner.Exec(ctx, expiry.SQL(schema), name); err != nil {
			t.Fatal(err)
		}
	}
	// frozen leaves a transaction of pool's role idle after checking a new
	// lease's token, and expires the lease.
	frozen := func(pool *pgxpool.Pool, name string) pgx.Tx {
		t.Helper()
		c, err := lock.New(pool, lock.Config{Schema: schema, Logger: pgtest.Quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		l, err := c.TryAcquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		if err := l.Guard().Check(ctx, tx); err != nil {
			t.Fatal(err)
		}
		expire(name)
		return tx
	}

	same := frozen(app, "same-role")
	if _, err := taker.TryAcquire(ctx, "same-role"); err != nil {
		t.Fatalf("takeover of a lease whose holder of the same role sits idle in a guarded transaction: %v", err)
	}
	if _, err := same.Exec(ctx, "SELECT 1"); err == nil {
		t.Fatal("the idle holder's session is alive after the takeover")
	}
	if n := taker.Stats().IdleHoldersEnded; n != 1 {
		t.Fatalf("IdleHoldersEnded = %d, want 1", n)
	}

	other := frozen(owner, "superuser")
	logs := func() string {
		mu.Lock()
		defer mu.Unlock()
		return logged.String()
	}
	actx, cancel := context.WithCancel(ctx)
	waited := make(chan error, 1)
	go func() {
		_, err := taker.TryAcquire(actx, "superuser")
		waited <- err
	}()
	pgtest.Eventually(t, time.Minute, "the warning", func() bool {
		return strings.Contains(logs(), "to end them, failed") || len(waited) > 0
	})
	cancel()
	if err := <-waited; !errors.Is(err, context.Canceled) {
		t.Fatalf("takeover behind a superuser's idle guarded transaction: %v, want it to wait until its context ends", err)
	}
	if _, err := other.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("the superuser's session was ended: %v", err)
	}
	if out := logs(); strings.Count(out, "to end them, failed") != 1 || !strings.Contains(out, "pg_signal_backend") {
		t.Fatalf("want one warning naming pg_signal_backend, logged:\n%s", out)
	}
}

// writerFunc is an io.Writer made of a function.
type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
