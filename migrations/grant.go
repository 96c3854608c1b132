package migrations

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgexec"
)

// AppGrants returns the statements that give role exactly what an
// application needs to use pgfence in schema ("" means DefaultSchema; after
// Up): acquire, renew,
// release and force-release leases, guard transactions, admit resource
// fences, run jobs and read and prune the ledger, and call Up and Verify when
// the schema is current. Nothing else: no DELETE or TRUNCATE of leases or
// fences, no UPDATE of their keys (a lease's name, a fence's resource), no
// DDL. A table-wide UPDATE on them, which earlier grants gave, is revoked
// first. See README's "Roles and what they may do".
func AppGrants(schema, role string) ([]string, error) {
	s, r, err := quoted(schema, role)
	if err != nil {
		return nil, err
	}
	return appGrantSQL(schema, s, r), nil
}

// OperatorGrants returns the statements that give role what the operator
// CLI needs in schema: list leases and runs, force-release a lease, prune
// the ledger, and see the migration status; as AppGrants, no UPDATE of a
// lease's name. (`pgfence run` acquires leases like an application: give
// its role AppGrants too.)
func OperatorGrants(schema, role string) ([]string, error) {
	s, r, err := quoted(schema, role)
	if err != nil {
		return nil, err
	}
	return operatorGrantSQL(schema, s, r), nil
}

// GrantApp runs AppGrants on db, in one transaction.
func GrantApp(ctx context.Context, db fence.DB, schema, role string) error {
	if err := ctxcheck.NotNil(ctx, "migrations: GrantApp"); err != nil {
		return err
	}
	return grant(ctx, db, AppGrants, schema, role)
}

// GrantOperator runs OperatorGrants on db, in one transaction.
func GrantOperator(ctx context.Context, db fence.DB, schema, role string) error {
	if err := ctxcheck.NotNil(ctx, "migrations: GrantOperator"); err != nil {
		return err
	}
	return grant(ctx, db, OperatorGrants, schema, role)
}

func grant(ctx context.Context, db fence.DB, stmts func(string, string) ([]string, error), schema, role string) error {
	list, err := stmts(schema, role)
	if err != nil {
		return err
	}
	tx, err := db.Begin(ctx) // a savepoint when db is a transaction
	if err != nil {
		return fmt.Errorf("migrations: grant to %q: %w", role, err)
	}
	defer pgexec.Rollback(ctx, tx)
	for _, st := range list {
		if _, err := tx.Exec(ctx, st); err != nil {
			return fmt.Errorf("migrations: grant to %q: %w", role, err)
		}
	}
	return tx.Commit(ctx)
}

// quoted validates and quotes the schema and role names.
func quoted(schema, role string) (string, string, error) {
	if err := ident.ValidateSchema(schema); err != nil {
		return "", "", fmt.Errorf("migrations: %w", err)
	}
	if err := ident.ValidateSchema(role); err != nil || role == "" {
		return "", "", fmt.Errorf("migrations: invalid role name %q", role)
	}
	return pgx.Identifier{ident.Schema(schema)}.Sanitize(), pgx.Identifier{role}.Sanitize(), nil
}
