package main

import (
	"context"
	"errors"
	"flag"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/printable"
	"github.com/pgfence/pgfence/migrations"
)

// cmdGrant gives a role what an application or the operator CLI needs in
// the schema: migrations.AppGrants or OperatorGrants, in one transaction.
func cmdGrant(ctx context.Context, e *env, args []string) error {
	var printOnly bool
	fs, err := parse(e, "grant", args, func(fs *flag.FlagSet) {
		fs.BoolVar(&printOnly, "print", false, "print the GRANT statements instead of running them")
	})
	if err != nil {
		return err
	}
	if fs.NArg() != 2 {
		fs.Usage()
		return fail(exitUsage, "grant takes two arguments: app or operator, and the role")
	}
	kind, role := fs.Arg(0), fs.Arg(1)
	var (
		stmts func(string, string) ([]string, error)
		grant func(context.Context, fence.DB, string, string) error
	)
	switch kind {
	case "app":
		stmts, grant = migrations.AppGrants, migrations.GrantApp
	case "operator":
		stmts, grant = migrations.OperatorGrants, migrations.GrantOperator
	default:
		fs.Usage()
		return fail(exitUsage, "grant %q: want app (what an application needs) or operator (what this CLI needs)", kind)
	}
	list, err := stmts(e.schemaName(), role)
	if err != nil {
		return fail(exitUsage, "%v", err)
	}
	if printOnly {
		for _, st := range list {
			fmt.Fprintln(e.stdout, st+";")
		}
		return nil
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	if err := grant(ctx, pool, e.schema, role); err != nil {
		var pg *pgconn.PgError
		if errors.As(err, &pg) && pg.Code == "42704" {
			return fmt.Errorf("%w\n(create the role first: CREATE ROLE %s LOGIN)", err, role)
		}
		if errors.As(err, &pg) && pg.Code == "42501" {
			return fmt.Errorf("%w\n(run grant as the owner of schema %q, the role that ran `pgfence migrate up`)", err, e.schema)
		}
		return err
	}
	fmt.Fprintf(e.stdout, "granted %s's privileges on schema %s to %s\n", kind, printable.String(e.schema), printable.String(role))
	return nil
}
