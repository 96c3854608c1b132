// Command billing is the story pgfence exists for, runnable.
//
// Three workers compete to run the nightly charge. The leader is paused
// (SIGSTOP) in the middle of the run, longer than its lease; a second worker
// takes over and charges the remaining customers; then the first wakes up,
// still believing it leads, and tries to charge again with its old token. With
// fencing its write is refused by the database; with -unfenced it charges a
// customer twice.
//
//	go run ./examples/billing            # fenced: duplicates: 0
//	go run ./examples/billing -unfenced  # the double charge
//
// The database: DATABASE_URL, else a throwaway private PostgreSQL server
// that it starts and removes at exit.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/examples/internal/exampledb"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

// urlEnv passes the resolved database to the worker processes.
const urlEnv = "PGFENCE_DEMO_URL"

var customers = []string{"alice", "bob", "carol", "dave", "erin"}

func main() {
	var (
		unfenced = flag.Bool("unfenced", false, "charge without the fence, to see the double charge")
		schema   = flag.String("schema", "pgfence_billing_demo", "schema for the demo's tables (dropped and recreated)")
		ttl      = flag.Duration("ttl", time.Second, "lease TTL")
		worker   = flag.Int("worker", 0, "internal: run as worker N")
	)
	flag.Parse()
	var err error
	if *worker > 0 {
		err = runWorker(*worker, *schema, *ttl, *unfenced)
	} else {
		err = orchestrate(*schema, *ttl, *unfenced)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "billing:", err)
		os.Exit(1)
	}
}

func orchestrate(schema string, ttl time.Duration, unfenced bool) error {
	ctx := context.Background()
	db, err := exampledb.Open(ctx, os.Stdout)
	if err != nil {
		return err
	}
	defer db.Close()
	pool, where := db.Pool, db.Where
	mode := "fenced"
	if unfenced {
		mode = "UNFENCED"
	}
	fmt.Printf("pgfence billing demo (%s), database: %s\n\n", mode, where)
	if err := setup(ctx, pool, schema); err != nil {
		return err
	}

	var (
		mu      sync.Mutex
		procs   = map[int]*exec.Cmd{}
		leader  = 0
		paused  = make(chan int, 1)
		resumed = false
		otherOK = make(chan struct{}, 1)
		refused = 0
		wg      sync.WaitGroup
	)
	self, err := os.Executable()
	if err != nil {
		return err
	}
	// Each worker's lines are relayed; the orchestrator pauses the first
	// leader after its second charge, and resumes it once another worker
	// has finished the run.
	onLine := func(id int, line string) {
		fmt.Println(line)
		mu.Lock()
		defer mu.Unlock()
		switch {
		case strings.Contains(line, "leading with token") && leader == 0:
			leader = id
		case id == leader && strings.Contains(line, "charged bob") && !resumed:
			select {
			case paused <- id:
			default:
			}
		case id != leader && strings.Contains(line, "done"):
			select {
			case otherOK <- struct{}{}:
			default:
			}
		case strings.Contains(line, "REFUSED"):
			refused++
		}
	}
	for id := 1; id <= 3; id++ {
		cmd := exec.Command(self, "-worker", fmt.Sprint(id), "-schema", schema, "-ttl", ttl.String(), fmt.Sprintf("-unfenced=%v", unfenced))
		cmd.Env = append(os.Environ(), urlEnv+"="+pool.Config().ConnString())
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			return err
		}
		if err := cmd.Start(); err != nil {
			return err
		}
		procs[id] = cmd
		wg.Add(1)
		go func() {
			defer wg.Done()
			relay(out, func(l string) { onLine(id, l) })
		}()
		time.Sleep(50 * time.Millisecond)
	}

	select {
	case id := <-paused:
		_ = procs[id].Process.Signal(syscall.SIGSTOP)
		fmt.Printf("== worker %d paused (SIGSTOP): a GC pause, a VM stall... longer than its %v lease\n", id, ttl)
		select {
		case <-otherOK:
		case <-time.After(20 * ttl):
		}
		mu.Lock()
		resumed = true
		mu.Unlock()
		fmt.Printf("== worker %d resumed (SIGCONT): it still believes it leads\n", id)
		_ = procs[id].Process.Signal(syscall.SIGCONT)
	case <-time.After(30 * time.Second):
		return errors.New("the leader never got to its second charge")
	}
	// Every line is read before Wait, which closes the pipes: a worker's
	// last words (its refusal) are printed just before it exits.
	wg.Wait()
	for _, p := range procs {
		_ = p.Wait()
	}
	return report(ctx, pool, schema, refused)
}

func relay(r io.Reader, fn func(string)) {
	s := bufio.NewScanner(r)
	for s.Scan() {
		fn(s.Text())
	}
}

func setup(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	q := pgx.Identifier{schema}.Sanitize()
	if err := freshSchema(ctx, pool, schema); err != nil {
		return err
	}
	for _, stmt := range []string{
		"CREATE TABLE " + q + ".customers (name text PRIMARY KEY)",
		"CREATE TABLE " + q + `.charges (customer text NOT NULL, night date NOT NULL, worker int NOT NULL,
			token bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`,
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			return err
		}
	}
	_, err := pool.Exec(ctx, "INSERT INTO "+q+".customers SELECT unnest($1::text[])", customers)
	return err
}

func report(ctx context.Context, pool *pgxpool.Pool, schema string, refused int) error {
	q := pgx.Identifier{schema}.Sanitize()
	rows, err := pool.Query(ctx, "SELECT customer, count(*), string_agg(format('token %s by worker %s', token, worker), ', ' ORDER BY at) FROM "+
		q+".charges GROUP BY customer ORDER BY customer")
	if err != nil {
		return err
	}
	defer rows.Close()
	fmt.Println("\nledger:")
	charged, total, dups := 0, 0, 0
	for rows.Next() {
		var (
			c   string
			n   int
			who string
		)
		if err := rows.Scan(&c, &n, &who); err != nil {
			return err
		}
		fmt.Printf("  %-6s charged %d time(s): %s\n", c, n, who)
		charged++
		total += n
		dups += n - 1
	}
	if err := rows.Err(); err != nil {
		return err
	}
	fmt.Printf("customers charged: %d of %d\ncharges: %d\nduplicates: %d\nstale writes refused: %d\n",
		charged, len(customers), total, dups, refused)
	return nil
}

// runWorker is one replica: campaign, then charge every customer not yet
// charged tonight, one by one, each charge taking a while.
func runWorker(id int, schema string, ttl time.Duration, unfenced bool) error {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv(urlEnv))
	if err != nil {
		return err
	}
	defer pool.Close()
	c, err := lock.New(pool, lock.Config{Schema: schema, TTL: ttl, RenewInterval: ttl / 4,
		PollInterval: 100 * time.Millisecond, Holder: fmt.Sprintf("worker-%d", id),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return err
	}
	defer c.Close(ctx)
	say := func(format string, a ...any) { fmt.Printf("worker %d: %s\n", id, fmt.Sprintf(format, a...)) }

	l, err := c.Acquire(ctx, "nightly-billing")
	if err != nil {
		return err
	}
	say("leading with token %d", l.Token())
	go func() {
		<-l.Done()
		if cause := context.Cause(l.Context()); !errors.Is(cause, lock.ErrReleased) {
			say("(lease context cancelled: %v)", cause)
		}
	}()
	q := pgx.Identifier{schema}.Sanitize()
	rows, err := pool.Query(ctx, "SELECT name FROM "+q+".customers c WHERE NOT EXISTS (SELECT 1 FROM "+q+
		".charges WHERE customer = c.name AND night = current_date) ORDER BY name")
	if err != nil {
		return err
	}
	todo, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	say("%d customers to charge tonight", len(todo))
	insert := "INSERT INTO " + q + ".charges (customer, night, worker, token) VALUES ($1, current_date, $2, $3)"
	for _, cust := range todo {
		time.Sleep(300 * time.Millisecond) // the payment provider is slow
		// A stale process does not know it is stale: it charges with the
		// token it has. Only the fence at the database can stop it.
		if unfenced {
			_, err = pool.Exec(ctx, insert, cust, id, int64(l.Token()))
		} else {
			err = l.Guard().RunTx(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, insert, cust, id, int64(l.Token()))
				return err
			})
		}
		var stale *fence.StaleTokenError
		if errors.As(err, &stale) {
			say("charge for %s REFUSED: stale token %d (current %d)", cust, stale.Presented, stale.Current)
			say("stopping: a newer leader holds the job")
			return nil
		}
		if err != nil {
			return err
		}
		say("charged %s (token %d)", cust, l.Token())
	}
	_ = l.Release(ctx)
	say("done")
	return nil
}

// freshSchema drops schema (with everything in it) and applies pgfence's
// migrations there, so the demo starts from a clean slate on every run.
func freshSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return err
	}
	_, err := migrations.Up(ctx, pool, schema)
	return err
}
