package migrations_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

func ExampleUp() {
	db, cleanup := pgtest.ForExample() // a pool on the test database
	defer cleanup()
	ctx := context.Background()
	schema := db.Schema + "_app"
	defer db.Pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")

	version, err := migrations.Up(ctx, db.Pool, schema) // creates the schema if needed
	if err != nil {
		panic(err)
	}
	fmt.Println("pgfence schema version", version)
	// Output:
	// pgfence schema version 3
}
