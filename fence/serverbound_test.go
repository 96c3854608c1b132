package fence_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// The server-side bounds that BenchmarkServerIdleBounds prices each end a
// guarded transaction left idle past them: idle_in_transaction_session_timeout
// set in the check's round trip (Guard.IdleTimeout), sent with BEGIN, or set
// on the pool's connections, and PostgreSQL 17's transaction_timeout sent
// with BEGIN or set on the pool's connections (on 17 or newer). The
// control, no bound, is still open when the bounded ones have ended.
func TestServerBoundsEndAnIdleGuardedTransaction(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	_, ins, g := benchTable(t, db, "bounded")
	var major int
	if err := db.Pool.QueryRow(ctx, "SELECT current_setting('server_version_num')::int / 10000").Scan(&major); err != nil {
		t.Fatal(err)
	}
	// Long enough that a loaded machine's stall does not end a transaction
	// inside open (a transaction_timeout counts from BEGIN); if one does,
	// the error says so, and that form is ended all the same.
	const bound = time.Second
	setting := fmt.Sprintf("'%dms'", bound.Milliseconds())
	bounded := g
	bounded.IdleTimeout = bound
	type form struct {
		name  string
		g     fence.Guard
		begin string
		pool  *pgxpool.Pool
	}
	withParam := func(param string) *pgxpool.Pool {
		return pgtest.NewPool(t, pgtest.UniqueName(param), func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams[param] = fmt.Sprint(bound.Milliseconds())
		})
	}
	forms := []form{
		{"idle_check", bounded, "", db.Pool},
		{"idle_begin", g, "BEGIN; SET LOCAL idle_in_transaction_session_timeout = " + setting, db.Pool},
		{"idle_pool", g, "", withParam("idle_in_transaction_session_timeout")},
	}
	if major >= 17 {
		forms = append(forms,
			form{"txn_begin", g, "BEGIN; SET LOCAL transaction_timeout = " + setting, db.Pool},
			form{"txn_pool", g, "", withParam("transaction_timeout")})
	}
	open := func(f form) (pgx.Tx, int) {
		t.Helper()
		tx, err := f.pool.BeginTx(ctx, pgx.TxOptions{BeginQuery: f.begin})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		pid := int(tx.Conn().PgConn().PID()) // a direct connection: its backend
		if _, err := f.g.Exec(ctx, tx, ins, f.name); err != nil {
			var pg *pgconn.PgError
			if errors.As(err, &pg) && (pg.Code == "25P03" || pg.Code == "25P04") && f.name != "none" {
				t.Logf("%s: ended by its bound already while it was opened: %v", f.name, err)
				return tx, pid
			}
			t.Fatalf("%s: %v", f.name, err)
		}
		return tx, pid
	}
	// Looks at the sessions from a pool of its own: db.Pool's connections
	// are held by the transactions under test.
	observer := pgtest.NewPool(t, pgtest.UniqueName("observer"))
	alive := func(pid int) (bool, error) {
		var alive bool
		err := observer.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid).Scan(&alive)
		return alive, err
	}
	control, controlPID := open(form{"none", g, "", db.Pool})
	for _, f := range forms {
		tx, pid := open(f)
		pgtest.Eventually(t, 30*time.Second, f.name+"'s session ended by the server", func() bool {
			up, err := alive(pid)
			return err == nil && !up
		})
		if _, err := tx.Exec(ctx, "SELECT 1"); err == nil {
			t.Fatalf("%s: the transaction still answers after its session ended", f.name)
		}
		_ = tx.Rollback(ctx) // its dead connection out of the pool
	}
	if up, err := alive(controlPID); err != nil || !up {
		t.Fatalf("the unbounded transaction's session ended too (%v): the check cannot tell", err)
	}
	if _, err := control.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatalf("the unbounded transaction: %v", err)
	}
	t.Logf("PostgreSQL %d: %d bounded forms ended", major, len(forms))
}
