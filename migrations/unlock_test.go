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

// The release of the migration lock, which goose sends with Up's deadline
// stripped once it has migrated, returns within wait.PastDeadline of that
// deadline when the server stops answering (a partition that black-holes
// packets). The session-level lock ends with the server's session.
func TestMigrationUnlockReturnsWhenTheServerStopsAnswering(t *testing.T) {
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
	schema := pgtest.UniqueName("unlock")
	if err := migrations.Lock(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	proxy.Set(faultproxy.Blackhole)
	done := make(chan error, 1)
	deadline := time.Now().Add(300 * time.Millisecond)
	uctx, ucancel := context.WithDeadline(ctx, deadline)
	defer ucancel()
	go func() { done <- migrations.Unlock(uctx, conn, schema) }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("the unlock reports success although the server never answered")
		}
		if late := time.Since(deadline); late > wait.PastDeadline+500*time.Millisecond {
			t.Fatalf("the unlock returned %v past its caller's deadline (allowed: wait.PastDeadline, %v)", late, wait.PastDeadline)
		}
	case <-time.After(20 * time.Second):
		proxy.Set(faultproxy.Reset) // lets the unlock return
		<-done
		t.Fatal("the unlock was still waiting for the server 20 s after the network was cut")
	}
	_ = conn.Close()
}
