package lock_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/pgfencetest"
)

func ExampleClient_TryAcquire() {
	ctx := context.Background()
	// A fresh schema on $PGFENCE_TEST_DATABASE_URL (or TEST_DATABASE_URL,
	// DATABASE_URL), dropped at the end. In a program: your pool, and
	// migrations.Up(ctx, pool, "pgfence").
	db, cleanup, err := pgfencetest.Open(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()

	a, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, Holder: "node-a"})
	if err != nil {
		log.Fatal(err)
	}
	defer a.Close(ctx)
	b, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, Holder: "node-b"})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close(ctx)

	l, err := a.TryAcquire(ctx, "nightly-billing")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("node-a holds it with token", l.Token())

	_, err = b.TryAcquire(ctx, "nightly-billing")
	var held *lock.HeldError
	if errors.As(err, &held) {
		fmt.Println("node-b is refused: held by", held.Holder)
	}

	if err := l.Release(ctx); err != nil {
		log.Fatal(err)
	}
	l2, err := b.TryAcquire(ctx, "nightly-billing")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("after release node-b gets token", l2.Token())
	// Output:
	// node-a holds it with token 1
	// node-b is refused: held by node-a
	// after release node-b gets token 2
}

func ExampleElection() {
	db, cleanup, err := pgfencetest.Open(context.Background()) // see ExampleClient_TryAcquire
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	c, err := lock.New(db.Pool, lock.Config{Schema: db.Schema})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close(context.Background())

	ctx, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	e := &lock.Election{
		Client: c,
		Name:   "compactor",
		Lead: func(ctx context.Context, l *lock.Lease) error {
			fmt.Println("leading with token", l.Token())
			stop() // a real leader works until ctx ends: loss or shutdown
			<-ctx.Done()
			return nil
		},
		OnStop: func(l *lock.Lease, err error) { fmt.Println("stopped leading") },
	}
	if err := e.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// leading with token 1
	// stopped leading
}
