package migrations_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pgfencetest"
)

func ExampleUp() {
	ctx := context.Background()
	// A pool on $PGFENCE_TEST_DATABASE_URL (or TEST_DATABASE_URL,
	// DATABASE_URL); in a program, your own pool.
	db, cleanup, err := pgfencetest.Open(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	schema := db.Schema + "_app"
	defer db.Pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")

	version, err := migrations.Up(ctx, db.Pool, schema) // creates the schema if needed; safe from every replica at once
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("pgfence schema version", version)
	// Output:
	// pgfence schema version 5
}
