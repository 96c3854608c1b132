package fence_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// frozenEnv makes the test binary a holder process (frozenHolder): "schema
// idle" where idle is the client's GuardIdleTimeout.
const frozenEnv = "PGFENCE_FROZEN_HOLDER"

// frozenTTL and frozenPoll are the holder's TTL and the next holder's
// PollInterval.
const (
	frozenTTL  = 2 * time.Second
	frozenPoll = 200 * time.Millisecond
)

// frozenHolder acquires the lease "frozen", opens a guarded transaction
// (Guard.RunTx under a context that never ends, as a worker handed the
// token would: nothing local stops it), writes a row, says "in-tx TOKEN" and
// waits for a line on stdin; the test freezes it there. Then it writes a
// second row and commits, and says "result ERR".
func frozenHolder(spec string) int {
	schema, idleText, _ := strings.Cut(spec, " ")
	idle, err := time.ParseDuration(idleText)
	if err != nil {
		fmt.Println("result bad spec:", err)
		return 2
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv(pgtest.EnvURL))
	if err != nil {
		fmt.Println("result connect:", err)
		return 1
	}
	defer pool.Close()
	c, err := lock.New(pool, lock.Config{Schema: schema, TTL: frozenTTL, GuardIdleTimeout: idle, Holder: "frozen-holder"})
	if err != nil {
		fmt.Println("result client:", err)
		return 1
	}
	l, err := c.TryAcquire(ctx, "frozen")
	if err != nil {
		fmt.Println("result acquire:", err)
		return 1
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	in := bufio.NewScanner(os.Stdin)
	attempt := 0
	err = l.Guard().RunTx(ctx, pool, func(tx pgx.Tx) error {
		attempt++
		if _, err := tx.Exec(ctx, "INSERT INTO "+effects+" VALUES ($1, $2)", fmt.Sprintf("first-%d", attempt), int64(l.Token())); err != nil {
			return err
		}
		if attempt == 1 {
			fmt.Printf("in-tx %d\n", l.Token())
			in.Scan() // frozen here
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+effects+" VALUES ($1, $2)", fmt.Sprintf("late-%d", attempt), int64(l.Token()))
		return err
	})
	fmt.Printf("result %v\n", err)
	return 0
}

// A holder frozen (SIGSTOP) inside an open guarded transaction keeps the
// lease row locked, and every takeover and ForceRelease waits for that lock.
// Once the lease has expired, the one waiting ends the session of a
// transaction idle on the row (with no idle bound at the server), so the
// next holder gets the lease within TTL + PollInterval + 1 s of the freeze;
// the frozen holder's late commit, after it is thawed, is refused and
// nothing of its transaction is in the table. With the holder's own idle
// bound (GuardIdleTimeout) the server ends it instead, for a taker that
// waits. The control, a taker that waits and no bound, shows the takeover
// blocked for the whole freeze, so the timing checked here is the doing of
// one of the two.
func TestFrozenHolderInGuardedTx(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		idle  time.Duration // the holder's GuardIdleTimeout (0: none)
		wait  bool          // the taker waits for idle holders (a negative IdleHolderAfter)
		force bool          // ForceRelease instead of a takeover
	}{
		{name: "takeover"},
		{name: "force release", force: true},
		{name: "takeover, server idle bound", idle: frozenTTL, wait: true},
		{name: "control: a taker that waits, no idle bound", wait: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			ctx := ctxT(t, time.Minute)
			effects := table(db, "effects")
			mustExec(t, db, "CREATE TABLE "+effects+" (id text PRIMARY KEY, token bigint)")
			exe, err := os.Executable()
			if err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command(exe)
			cmd.Env = append(os.Environ(), frozenEnv+"="+db.Schema+" "+tc.idle.String())
			cmd.Stderr = os.Stderr
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			stdout, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			lines := make(chan string, 8)
			relayed := make(chan struct{})
			go func() {
				defer close(relayed)
				defer close(lines)
				sc := bufio.NewScanner(stdout)
				for sc.Scan() {
					lines <- sc.Text()
				}
			}()
			t.Cleanup(func() {
				_ = cmd.Process.Signal(syscall.SIGCONT)
				_ = cmd.Process.Kill()
				<-relayed
				_ = cmd.Wait()
			})
			next := func(prefix string) string {
				select {
				case l, ok := <-lines:
					if !ok || !strings.HasPrefix(l, prefix) {
						t.Fatalf("holder said %q (open: %v), want %q...", l, ok, prefix)
					}
					return strings.TrimPrefix(l, prefix)
				case <-time.After(30 * time.Second):
					t.Fatalf("holder said nothing in 30s, want %q...", prefix)
				}
				return ""
			}
			oldTok, err := strconv.ParseInt(next("in-tx "), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			frozen := time.Now()

			// The next holder (or an operator) tries from the moment of the
			// freeze; the bound is TTL + PollInterval + 1 s.
			bound := frozenTTL + frozenPoll + time.Second
			cfg := lock.Config{PollInterval: frozenPoll}
			if tc.wait {
				cfg.IdleHolderAfter = -1
			}
			var endedEvents atomic.Int64 // the taker's IdleHolderEnded events
			cfg.OnEvent = func(e lock.Event) {
				if e.Kind == lock.IdleHolderEnded && e.Lease == "frozen" && e.Backend != nil && e.Backend.PID > 0 {
					endedEvents.Add(1)
				}
			}
			c := newClient(t, db, cfg)
			type res struct {
				tok   fence.Token
				err   error
				ended int // the sessions ForceRelease reported it ended
			}
			got := make(chan res, 1)
			actx, cancel := context.WithCancel(ctx)
			defer cancel()
			go func() {
				if tc.force {
					// An operator frees the lease once the holder's TTL has
					// passed, as one would who sees it overdue.
					for {
						info, err := lock.Inspect(actx, c.Pool(), c.Config().Schema, "frozen")
						if err != nil || info.ExpiresIn <= 0 {
							break
						}
						time.Sleep(frozenPoll)
					}
					freed, err := lock.ForceRelease(actx, c.Pool(), c.Config().Schema, "frozen")
					if err != nil {
						got <- res{0, err, 0}
						return
					}
					// Then a new holder, so that the frozen one is stale.
					l, err := c.TryAcquire(actx, "frozen")
					if err != nil {
						got <- res{0, err, 0}
						return
					}
					got <- res{l.Token(), nil, len(freed.Ended)}
					return
				}
				l, err := c.Acquire(actx, "frozen")
				var tok fence.Token
				if err == nil {
					tok = l.Token()
				}
				got <- res{tok, err, 0}
			}()
			control := tc.wait && tc.idle == 0
			var took time.Duration
			select {
			case r := <-got:
				took = time.Since(frozen)
				if r.err != nil {
					t.Fatalf("after %v: %v", took, r.err)
				}
				if control {
					t.Fatalf("control: the lease changed hands %v after the freeze with no idle bound: "+
						"the test cannot tell the bound's effect", took)
				}
				if int64(r.tok) <= oldTok {
					t.Fatalf("next holder's token %d, frozen holder's %d", r.tok, oldTok)
				}
				// The frozen session, ended, is reported: by ForceRelease,
				// or by the taker's event and Stats; none where the
				// server's bound ended it.
				want := 1
				if tc.wait {
					want = 0
				}
				if tc.force && r.ended != want {
					t.Fatalf("ForceRelease reported %d sessions ended, want %d", r.ended, want)
				}
				if n, st := endedEvents.Load(), c.Stats().IdleHoldersEnded; !tc.force && (n != int64(want) || st != uint64(want)) {
					t.Fatalf("the taker's IdleHolderEnded events %d and Stats.IdleHoldersEnded %d, want %d", n, st, want)
				}
				t.Logf("%s %v after the freeze (bound %v)", tc.name, took, bound)
			case <-time.After(bound):
				if !control {
					t.Fatalf("%s still waiting %v after the holder froze in its guarded transaction", tc.name, bound)
				}
				t.Logf("control: still blocked %v after the freeze, as expected without the bound", bound)
			}

			// Thaw the holder: its transaction goes on, writes, commits.
			if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
			if _, err := fmt.Fprintln(stdin, "go"); err != nil {
				t.Fatal(err)
			}
			result := next("result ")
			var rows []string
			r, err := db.Pool.Query(ctx, "SELECT id FROM "+effects+" ORDER BY id")
			if err != nil {
				t.Fatal(err)
			}
			rows, err = pgx.CollectRows(r, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if control {
				// Without the bound the frozen transaction held the lease
				// row all along, so it committed before any takeover: the
				// fence is intact, only liveness was lost. The takeover
				// then goes through.
				if result != "<nil>" || len(rows) != 2 {
					t.Fatalf("control: holder's transaction %s, rows %v; want committed, 2 rows", result, rows)
				}
				if r := <-got; r.err != nil {
					t.Fatalf("control: takeover after the thaw: %v", r.err)
				}
				return
			}
			if result == "<nil>" || !strings.Contains(result, "stale token") {
				t.Fatalf("the thawed holder's transaction answered %q; want it refused with a stale token", result)
			}
			if len(rows) != 0 {
				t.Fatalf("rows of the frozen holder's transaction committed after the lease changed hands: %v", rows)
			}
			t.Logf("thawed holder: %s", result)
		})
	}
}
