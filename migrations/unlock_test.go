package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/migrations"
)

// The release of the migration lock, which goose sends with Up's
// cancellation and deadline stripped once it has migrated, returns within
// wait.PastDeadline of the caller's context's end (its deadline, or a
// cancel such as Ctrl-C) when the server stops answering (a partition that
// black-holes packets).
func TestMigrationUnlockReturnsWhenTheServerStopsAnswering(t *testing.T) {
	for _, end := range []string{"deadline", "cancel"} {
		t.Run(end, func(t *testing.T) {
			url := pgtest.URL(t)
			proxy, err := faultproxy.To(url)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = proxy.Close() })
			cfg, err := pgx.ParseConfig(url)
			if err != nil {
				t.Fatal(err)
			}
			proxy.Route(&cfg.Config)
			db := stdlib.OpenDB(*cfg)
			t.Cleanup(func() { _ = db.Close() })
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			conn, err := db.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			schema := pgtest.UniqueName("unlock")
			if err := migrations.Lock(ctx, conn, schema); err != nil {
				t.Fatal(err)
			}
			proxy.Set(faultproxy.Blackhole)
			uctx, ucancel := context.WithCancel(ctx)
			defer ucancel()
			if end == "deadline" {
				uctx, ucancel = context.WithTimeout(ctx, 300*time.Millisecond)
				defer ucancel()
			}
			done := make(chan error, 1)
			go func() { done <- migrations.Unlock(uctx, conn, schema) }()
			if end == "cancel" {
				time.AfterFunc(300*time.Millisecond, ucancel)
			}
			<-uctx.Done()
			ended := time.Now()
			select {
			case err := <-done:
				if err == nil {
					t.Fatal("the unlock reports success although the server never answered")
				}
				if late := time.Since(ended); late > wait.PastDeadline+2*time.Second {
					t.Fatalf("the unlock returned %v after its caller's context ended (allowed: wait.PastDeadline, %v)", late, wait.PastDeadline)
				}
			case <-time.After(20 * time.Second):
				proxy.Set(faultproxy.Reset) // lets the unlock return
				<-done
				t.Fatal("the unlock was still waiting for the server 20 s after the network was cut")
			}
		})
	}
}
