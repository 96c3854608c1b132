package ownconn_test

import (
	"context"
	"errors"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// A multi-host URL whose first host accepts connections and never answers
// (a frozen server during a failover) and whose second is the test server:
// Dial connects within a deadline shorter than the hung host's
// connect_timeout, which pgx's one-host-after-another connect cannot.
func TestDialGetsPastAHungHost(t *testing.T) {
	hung, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close()
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	live := u.Host
	if u.Port() == "" {
		live += ":5432"
	}
	u.Host = hung.Addr().String() + "," + live
	q := u.Query()
	q.Set("connect_timeout", "30")
	q.Set("target_session_attrs", "read-write")
	u.RawQuery = q.Encode()
	cfg, err := pgx.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := pgx.ConnectConfig(ctx, cfg.Copy()); err == nil {
		t.Fatal("pgx connected past the hung host within the deadline; the test proves nothing")
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel2()
	conn, err := ownconn.Dial(ctx2, cfg)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer conn.Close(context.Background())
	var one int
	if err := conn.QueryRow(ctx2, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("query on the dialled connection: %d, %v", one, err)
	}
}

// A Link whose connects never complete: Do waits for the one in flight
// only as long as its context, opens none of the pool's, and Close ends
// the connect in flight and returns.
func TestLinkWaitsForItsConnectOnlyAsLongAsItsContext(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error {
		<-ctx.Done() // a connect that never completes
		return ctx.Err()
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	link := ownconn.NewLink(context.Background(), pool, time.Hour)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	ran := false
	err = link.Do(ctx, 100*time.Millisecond, func(context.Context, pgexec.DB) error { ran = true; return nil })
	if ran || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Do with no connection to be had: ran %v, err %v; want not run, and the deadline", ran, err)
	}
	if n := pool.Stat().TotalConns(); n != 0 {
		t.Fatalf("the pool has %d connections: Do started a connect of the pool's", n)
	}
	closed := make(chan struct{})
	go func() { link.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not end the connect in flight within 10 s")
	}
}

// A Link whose connects stall, on a pool with an idle connection: once
// wait has passed, Do runs fn on that connection, with a context bounded
// by wait (a pooled connection may lead to a server that is gone); a run
// that gets no answer is tried again, a wait later, until Do's context
// ends.
func TestLinkFallsBackToAnIdlePooledConnectionWithinWait(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	stalled := make(chan struct{})
	cfg.BeforeConnect = func(ctx context.Context, _ *pgx.ConnConfig) error {
		select {
		case <-stalled:
			<-ctx.Done() // a connect that never completes
			return ctx.Err()
		default:
			return nil
		}
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := pool.Ping(context.Background()); err != nil { // one idle connection
		t.Fatal(err)
	}
	close(stalled)
	link := ownconn.NewLink(context.Background(), pool, time.Hour)
	defer link.Close()
	const wait = 200 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	type run struct{ began, bound time.Duration } // from Do's start; the run's time left
	var runs []run
	start := time.Now()
	err = link.Do(ctx, wait, func(ctx context.Context, db pgexec.DB) error {
		d, ok := ctx.Deadline()
		if !ok {
			t.Error("fn ran without a deadline")
		}
		runs = append(runs, run{time.Since(start), time.Until(d)})
		if err := db.QueryRow(ctx, "SELECT 1").Scan(new(int)); err != nil {
			return err
		}
		<-ctx.Done() // a server that stops answering
		return ctx.Err()
	})
	if !errors.Is(err, context.DeadlineExceeded) || ctx.Err() == nil {
		t.Fatalf("Do returned %v with its context live (%v): want it to go on until its context ended", err, ctx.Err())
	}
	if len(runs) < 2 {
		t.Fatalf("fn ran %d times in 3 s: want the pooled run tried again after it got no answer", len(runs))
	}
	if runs[0].began < wait {
		t.Fatalf("the first pooled run began %v after Do, before wait (%v) had passed", runs[0].began, wait)
	}
	for i, r := range runs {
		if r.bound > wait {
			t.Fatalf("pooled run %d had %v to run, more than wait (%v)", i, r.bound, wait)
		}
	}
}
