package lock_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

func ExampleClient_TryAcquire() {
	db, cleanup := pgtest.ForExample()
	defer cleanup()
	ctx := context.Background()

	a, _ := lock.New(db.Pool, lock.Config{Schema: db.Schema, Holder: "node-a"})
	b, _ := lock.New(db.Pool, lock.Config{Schema: db.Schema, Holder: "node-b"})
	defer a.Close(ctx)
	defer b.Close(ctx)

	l, err := a.TryAcquire(ctx, "nightly-billing")
	if err != nil {
		panic(err)
	}
	fmt.Println("node-a holds it with token", l.Token())

	_, err = b.TryAcquire(ctx, "nightly-billing")
	var held *lock.HeldError
	if errors.As(err, &held) {
		fmt.Println("node-b is refused: held by", held.Holder)
	}

	_ = l.Release(ctx)
	l2, _ := b.TryAcquire(ctx, "nightly-billing")
	fmt.Println("after release node-b gets token", l2.Token())
	// Output:
	// node-a holds it with token 1
	// node-b is refused: held by node-a
	// after release node-b gets token 2
}

func ExampleElection() {
	db, cleanup := pgtest.ForExample()
	defer cleanup()
	c, _ := lock.New(db.Pool, lock.Config{Schema: db.Schema})
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
		panic(err)
	}
	// Output:
	// leading with token 1
	// stopped leading
}
