package fence_test

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/pgfencetest"
)

// A leader paused past its lease wakes up and tries to write with its old
// token: the guard refuses it in the same transaction.
func ExampleGuard_RunTx() {
	ctx := context.Background()
	db, cleanup, err := pgfencetest.Open(ctx) // a fresh schema on $PGFENCE_TEST_DATABASE_URL (or TEST_DATABASE_URL, DATABASE_URL)
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+db.Schema+".charges (customer text, token bigint)"); err != nil {
		log.Fatal(err)
	}
	c, err := lock.New(db.Pool, lock.Config{Schema: db.Schema})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close(ctx)

	charge := func(g fence.Guard) error {
		return g.RunTx(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+db.Schema+".charges VALUES ('alice', $1)", int64(g.Token))
			return err
		})
	}

	old, err := c.TryAcquire(ctx, "billing")
	if err != nil {
		log.Fatal(err)
	}
	stale := old.Guard()
	if err := old.Release(ctx); err != nil { // stands in for "paused past its TTL, lease taken over"
		log.Fatal(err)
	}
	current, err := c.TryAcquire(ctx, "billing")
	if err != nil {
		log.Fatal(err)
	}

	fmt.Println("current leader:", charge(current.Guard()))
	err = charge(stale)
	var se *fence.StaleTokenError
	if errors.As(err, &se) {
		fmt.Printf("stale leader refused: presented %d, current %d\n", se.Presented, se.Current)
	}
	// Output:
	// current leader: <nil>
	// stale leader refused: presented 1, current 2
}

// A resource outside PostgreSQL learns the token as a string and must keep
// its own high-water mark.
func ExampleParseToken() {
	t, err := fence.ParseToken("42")
	fmt.Println(t, err)
	_, err = fence.ParseToken("-1")
	fmt.Println(errors.Is(err, fence.ErrInvalidToken))
	// Output:
	// 42 <nil>
	// true
}
