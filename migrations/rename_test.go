package migrations_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// Neither the application role nor the operator role can rename a lease
// (its holder's renewals would miss the row and the lease end, unfenced
// until then) or a resource fence (the resource's mark would start again):
// they may UPDATE every column but the key, which is all the library
// needs. Running the grants again on a deployment made with the earlier,
// table-wide UPDATE takes that back. Formerly both grants gave UPDATE on
// the whole table, and the application role's rename of a lease succeeded.
func TestGrantsForbidRenames(t *testing.T) {
	t.Parallel()
	ctx := pgtest.Context(t, 2*time.Minute)
	owner := pgtest.NewPool(t, "rename-owner")
	schema := pgtest.Schema(t, "rename")
	if _, err := migrations.Up(ctx, owner, schema); err != nil {
		t.Fatal(err)
	}
	leases, fences := ident.Table(schema, "pgfence_leases"), ident.Table(schema, "pgfence_fences")
	appRole, opRole := newRole(t, owner, "pgfence_rename"), newRole(t, owner, "pgfence_rename_op")
	// The earlier grants' table-wide UPDATE, as on an existing deployment.
	for _, sql := range []string{
		"GRANT UPDATE ON " + leases + ", " + fences + " TO " + appRole,
		"GRANT UPDATE ON " + leases + " TO " + opRole,
	} {
		if _, err := owner.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	if err := migrations.GrantApp(ctx, owner, schema, appRole); err != nil {
		t.Fatal(err)
	}
	if err := migrations.GrantOperator(ctx, owner, schema, opRole); err != nil {
		t.Fatal(err)
	}

	// UPDATE on every column but the key: a column a later migration adds
	// must be granted too.
	updatable := func(role, table, key string) {
		t.Helper()
		rows, err := owner.Query(ctx, `SELECT a.attname::text, has_column_privilege($1, c.oid, a.attname, 'UPDATE')
  FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = $2 AND c.relname = $3 AND a.attnum > 0 AND NOT a.attisdropped`, role, schema, table)
		if err != nil {
			t.Fatal(err)
		}
		cols, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (col struct {
			name string
			ok   bool
		}, err error) {
			err = r.Scan(&col.name, &col.ok)
			return col, err
		})
		if err != nil || len(cols) == 0 {
			t.Fatalf("columns of %s: %v, %v", table, cols, err)
		}
		for _, c := range cols {
			if c.ok != (c.name != key) {
				t.Errorf("%s may UPDATE %s.%s: %v, want %v", role, table, c.name, c.ok, c.name != key)
			}
		}
	}
	updatable(appRole, "pgfence_leases", "name")
	updatable(appRole, "pgfence_fences", "resource")
	updatable(opRole, "pgfence_leases", "name")

	// Everything the library writes to the leases and fences, as the
	// application role: a first acquisition (INSERT), renewals, a release,
	// an acquisition of the free row (token = DEFAULT), a resource fence
	// admitted then raised, an observer, a blocked acquirer that asks for a
	// wake-up, Close's release of all, ForceRelease.
	app := pgtest.NewPool(t, "rename-app", func(c *pgxpool.Config) { c.ConnConfig.User = appRole })
	client := func(holder string) *lock.Client {
		c, err := lock.New(app, lock.Config{Schema: schema, Holder: holder, TTL: 600 * time.Millisecond,
			PollInterval: 50 * time.Millisecond, Logger: pgtest.Quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}
	a, b := client("a"), client("b")
	admit := func(l *lock.Lease) {
		t.Helper()
		err := l.RunTx(ctx, func(tx pgx.Tx) error {
			return fence.Resource{Name: "ledger", Schema: schema}.Admit(ctx, tx, l.Token())
		})
		if err != nil {
			t.Fatalf("admit token %d: %v", l.Token(), err)
		}
	}
	l, err := a.TryAcquire(ctx, "billing")
	if err != nil {
		t.Fatalf("first acquisition: %v", err)
	}
	admit(l)
	pgtest.Eventually(t, 10*time.Second, "a renewal", func() bool { return a.Stats().Renewals > 0 })
	if s := a.Stats(); s.RenewalFailures != 0 {
		t.Fatalf("renewals failed: %+v", s)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}
	if l, err = a.TryAcquire(ctx, "billing"); err != nil {
		t.Fatalf("acquisition of the free row: %v", err)
	}
	admit(l) // a greater token: the fence's UPDATE
	seen, err := b.Observe(ctx, "billing")
	if err != nil {
		t.Fatal(err)
	}
	if info := <-seen; info.Holder != "a" {
		t.Fatalf("observed %+v, want a holding it", info)
	}
	got := make(chan error, 1)
	go func() {
		l, err := b.Acquire(ctx, "billing")
		if err == nil {
			err = l.Release(ctx)
		}
		got <- err
	}()
	pgtest.Eventually(t, 10*time.Second, "the blocked acquirer's wake-up request", func() bool {
		var asked bool
		err := owner.QueryRow(ctx, "SELECT waiters_until > now() FROM "+leases+" WHERE name = 'billing'").Scan(&asked)
		return err == nil && asked
	})
	if err := a.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := <-got; err != nil {
		t.Fatalf("blocked acquisition: %v", err)
	}
	if _, err := lock.ForceRelease(ctx, b.Pool(), b.Config().Schema, "billing"); err != nil {
		t.Fatalf("ForceRelease: %v", err)
	}
	op := pgtest.NewPool(t, "rename-op", func(c *pgxpool.Config) { c.ConnConfig.User = opRole })
	oc, err := lock.New(op, lock.Config{Schema: schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer oc.Close(ctx)
	if _, err := lock.ForceRelease(ctx, oc.Pool(), oc.Config().Schema, "billing"); err != nil {
		t.Fatalf("ForceRelease as the operator: %v", err)
	}

	// The renames, refused for want of the privilege.
	for _, r := range []struct {
		who  string
		pool *pgxpool.Pool
		sql  string
	}{
		{"the application", app, "UPDATE " + leases + " SET name = 'x' WHERE name = 'billing'"},
		{"the application", app, "UPDATE " + fences + " SET resource = 'x' WHERE resource = 'ledger'"},
		{"the operator", op, "UPDATE " + leases + " SET name = 'x' WHERE name = 'billing'"},
	} {
		_, err := r.pool.Exec(ctx, r.sql)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "42501" {
			t.Errorf("%s: %s: %v, want SQLSTATE 42501", r.who, r.sql, err)
		}
	}
}
