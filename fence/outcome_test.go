package fence_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// When the connection breaks while COMMIT is in flight, RunTx asks the
// server on another connection what became of the transaction, instead of
// answering "outcome unknown": committed (the reply was lost on the way
// back) returns nil; aborted (COMMIT never reached a server that then ended
// the session) returns ErrNotCommitted, which is retryable.
func TestLostCommitReplyIsResolved(t *testing.T) {
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	up, err := pgx.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	link, err := faultproxy.New(net.JoinHostPort(up.Host, strconv.Itoa(int(up.Port))))
	if err != nil {
		t.Fatal(err)
	}
	defer link.Close()
	admin := pgtest.NewPool(t, "outcome-admin")
	charges := table(db, "charges")
	mustExec(t, db, "CREATE TABLE "+charges+" (id text PRIMARY KEY, token bigint)")
	c := newClient(t, db, lock.Config{})
	l, err := c.TryAcquire(ctx, "outcome")
	if err != nil {
		t.Fatal(err)
	}

	// onConnect runs (once) when the pool dials its next connection: the
	// one RunTx asks the server on.
	var onConnect atomic.Pointer[func()]
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(link.Addr())
	cfg.ConnConfig.Host = host
	p, _ := strconv.Atoi(port)
	cfg.ConnConfig.Port = uint16(p)
	cfg.ConnConfig.Fallbacks = nil
	cfg.BeforeConnect = func(context.Context, *pgx.ConnConfig) error {
		if f := onConnect.Swap(nil); f != nil {
			(*f)()
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	count := func(id string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+charges+" WHERE id = $1", id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// run runs a guarded insert whose COMMIT meets the fault; the
	// transaction's context ends after a second, as a lease's does.
	run := func(id string, fault faultproxy.Mode, resolve func(pid uint32)) (error, int) {
		attempts := 0
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		err := l.Guard().RunTx(rctx, pool, func(tx pgx.Tx) error {
			attempts++
			if _, err := tx.Exec(rctx, "INSERT INTO "+charges+" VALUES ($1, $2)", id, int64(l.Token())); err != nil {
				return err
			}
			if attempts == 1 {
				pid := tx.Conn().PgConn().PID()
				f := func() { resolve(pid); link.Set(faultproxy.Pass) }
				onConnect.Store(&f)
				link.Set(fault) // COMMIT is next
			}
			return nil
		})
		return err, attempts
	}

	// The COMMIT reaches the server; its reply is held until the client
	// has given up.
	err, attempts := run("reply-lost", faultproxy.HoldReplies, func(uint32) {})
	if err != nil || attempts != 1 || count("reply-lost") != 1 {
		t.Fatalf("a committed transaction whose COMMIT reply was lost: %v after %d attempts, %d rows; want nil, 1, 1",
			err, attempts, count("reply-lost"))
	}

	// The COMMIT is held before the server; the server ends the session
	// (the transaction aborts) before anyone asks.
	err, attempts = run("commit-lost", faultproxy.Blackhole, func(pid uint32) {
		if _, err := admin.Exec(context.Background(), "SELECT pg_terminate_backend($1, 5000)", pid); err != nil {
			panic(fmt.Sprint("terminate the guarded transaction's backend: ", err))
		}
	})
	// Its context has ended, so RunTx does not run it again: the caller may.
	if !errors.Is(err, fence.ErrNotCommitted) || errors.Is(err, fence.ErrOutcomeUnknown) || !fence.Retryable(err) ||
		attempts != 1 || count("commit-lost") != 0 {
		t.Fatalf("an aborted transaction whose COMMIT was lost: %v after %d attempts, %d rows; want ErrNotCommitted "+
			"(retryable), 1 attempt, no row", err, attempts, count("commit-lost"))
	}
	t.Logf("resolved: %v", err)
}
