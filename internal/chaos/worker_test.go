package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// Timings shared by workers and the suite. Every statement and transaction of
// a worker ends within opBound (statement_timeout, lock_timeout and
// idle_in_transaction_session_timeout are 2s; opBound adds margin), which bounds when an operation
// whose outcome the worker did not learn can still take effect.
const (
	leaseTTL  = 600 * time.Millisecond
	opBound   = 5 * time.Second
	customers = 5
	register  = "register"
	chargeJob = "nightly-charge"
)

// record is one operation of a worker's history, one JSON line each.
type record struct {
	Worker int    `json:"w"`
	Kind   string `json:"k"`   // acquire, write, read
	Token  int64  `json:"tok"` // acquire: obtained; write: presented
	Value  int64  `json:"val"` // write: written; read: read
	Out    string `json:"out"` // ok, refused, failed (certainly not committed), unknown
	Call   int64  `json:"call"`
	Ret    int64  `json:"ret"`
	Err    string `json:"err,omitempty"` // write: the error of a failed one
}

func workerMain() int {
	id, _ := strconv.Atoi(os.Getenv("CHAOS_ID"))
	fenced := os.Getenv("CHAOS_FENCED") == "1"
	seed, _ := strconv.ParseUint(os.Getenv("CHAOS_SEED"), 10, 64)
	f, err := os.OpenFile(os.Getenv("CHAOS_OUT"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	defer f.Close()
	var mu sync.Mutex
	rec := func(r record) {
		r.Worker = id
		b, _ := json.Marshal(r)
		mu.Lock()
		_, _ = f.Write(append(b, '\n'))
		mu.Unlock()
	}

	cfg, err := pgxpool.ParseConfig(os.Getenv("CHAOS_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	for k, v := range map[string]string{"application_name": fmt.Sprintf("chaos-w%d", id), "statement_timeout": "2000",
		"lock_timeout": "2000", "idle_in_transaction_session_timeout": "2000"} {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	cfg.ConnConfig.ConnectTimeout = time.Second
	cfg.MaxConns = 8
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	defer pool.Close()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	holder := fmt.Sprintf("w%d", id)
	lc, err := lock.New(pool, lock.Config{Schema: "pgfence", TTL: leaseTTL, RenewInterval: leaseTTL / 4,
		SafetyMargin: leaseTTL / 10, PollInterval: 50 * time.Millisecond, Holder: holder, Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	// One client for the register's lease and the runner's jobs, as in an
	// application.
	r, err := runner.New(lc, runner.Config{RebalanceInterval: 200 * time.Millisecond, ShutdownTimeout: 2 * time.Second})
	if err == nil {
		err = r.Register(runner.Job{Name: chargeJob, Schedule: "@every 1s", Run: chargeFn(pool, fenced, rand.New(rand.NewPCG(seed, uint64(id)+100)))})
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = r.Run(ctx) }()
	go func() {
		defer wg.Done()
		registerLoop(ctx, pool, lc, fenced, id, rand.New(rand.NewPCG(seed, uint64(id))), rec)
	}()
	wg.Wait()
	_ = lc.Close(context.Background())
	return 0
}

func now() int64 { return time.Now().UnixNano() }

// registerLoop campaigns for the register lease and, while it believes it
// holds it, writes unique values with its token and reads the register.
func registerLoop(ctx context.Context, pool *pgxpool.Pool, lc *lock.Client, fenced bool, id int, rng *rand.Rand, rec func(record)) {
	next := int64(id) * 1_000_000_000
	for ctx.Err() == nil {
		call := now()
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		l, err := lc.Acquire(actx, register)
		cancel()
		if err != nil {
			// The attempt may have been granted with the reply lost.
			rec(record{Kind: "acquire", Out: "unknown", Call: call, Ret: now()})
			continue
		}
		rec(record{Kind: "acquire", Token: int64(l.Token()), Out: "ok", Call: call, Ret: now()})
		for range 1 + rng.IntN(6) {
			if ctx.Err() != nil {
				break
			}
			time.Sleep(time.Duration(rng.IntN(40)) * time.Millisecond)
			if rng.IntN(3) == 0 {
				read(pool, rec)
			}
			next++
			write(pool, l.Guard(), next, fenced, rec)
		}
		rctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = l.Release(rctx)
		cancel()
	}
}

// write stores v in the register (and its log) with token g.Token: fenced by
// the lease guard and the data schema's resource fence, or, in the negative
// control, not at all. Its context is not the worker's: a write that has
// started finishes and is recorded.
func write(pool *pgxpool.Pool, g fence.Guard, v int64, fenced bool, rec func(record)) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	call := now()
	body := func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "UPDATE data.register SET value = $1 WHERE id = 1", v); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO data.write_log (value, token) VALUES ($1, $2)", v, int64(g.Token)); err != nil {
			return err
		}
		if fenced {
			return fence.Resource{Name: register, Schema: "data"}.Admit(ctx, tx, g.Token)
		}
		return nil
	}
	var err error
	if fenced {
		err = g.RunTx(ctx, pool, body)
	} else {
		err = pgx.BeginFunc(ctx, pool, body)
	}
	out := "ok"
	switch {
	case errors.Is(err, fence.ErrStaleToken):
		out = "refused"
	case fenced && fence.Retryable(err):
		out = "failed" // RunTx says it did not commit: the checker holds it to that
	case err != nil:
		out = "unknown"
	}
	r := record{Kind: "write", Token: int64(g.Token), Value: v, Out: out, Call: call, Ret: now()}
	if out == "failed" {
		r.Err = err.Error()
	}
	rec(r)
}

func read(pool *pgxpool.Pool, rec func(record)) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	call := now()
	var v int64
	if err := pool.QueryRow(ctx, "SELECT value FROM data.register WHERE id = 1").Scan(&v); err == nil {
		rec(record{Kind: "read", Value: v, Out: "ok", Call: call, Ret: now()})
	}
}

// chargeFn is the nightly billing job: it lists the customers not yet
// charged for the night, then charges them one by one, slowly. A worker
// paused in the middle wakes with a stale list.
func chargeFn(pool *pgxpool.Pool, fenced bool, rng *rand.Rand) func(context.Context, *runner.Run) error {
	var mu sync.Mutex
	return func(ctx context.Context, run *runner.Run) error {
		rows, err := pool.Query(ctx, `SELECT c FROM generate_series(1, $1) c WHERE NOT EXISTS
			(SELECT 1 FROM data.charges WHERE customer = c AND night = $2)`, customers, run.Slot)
		if err != nil {
			return err
		}
		todo, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return err
		}
		for _, c := range todo {
			mu.Lock()
			d := time.Duration(10+rng.IntN(40)) * time.Millisecond
			mu.Unlock()
			time.Sleep(d) // the payment provider is slow
			wctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			insert := "INSERT INTO data.charges (customer, night, token) VALUES ($1, $2, $3)"
			if fenced {
				err = run.RunTx(wctx, func(tx pgx.Tx) error {
					_, err := tx.Exec(wctx, insert, c, run.Slot, int64(run.Token))
					return err
				})
			} else {
				_, err = pool.Exec(wctx, insert, c, run.Slot, int64(run.Token))
			}
			cancel()
			if err != nil {
				return err
			}
		}
		return nil
	}
}
