package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/pgfence/pgfence/lock"
)

// River's leader election side by side with pgfence's Election: how long
// from a leader's graceful stop, and from its SIGKILL, to the next leader,
// and what a waiting client sends meanwhile.

const riverSchema = "pgfence_bench_river"

type noopArgs struct{}

func (noopArgs) Kind() string { return "pgfence_bench_noop" }

type noopWorker struct{ river.WorkerDefaults[noopArgs] }

func (noopWorker) Work(context.Context, *river.Job[noopArgs]) error { return nil }

var quietRiver = slog.New(slog.NewTextHandler(io.Discard, nil))

// newRiver returns a River client (default configuration: one queue, one
// worker) with id on pool, in riverSchema.
func newRiver(pool *pgxpool.Pool, id string) (*river.Client[pgx.Tx], error) {
	workers := river.NewWorkers()
	river.AddWorker(workers, &noopWorker{})
	return river.NewClient(riverpgxv5.New(pool), &river.Config{ID: id, Schema: riverSchema, Logger: quietRiver,
		Queues: map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 1}}, Workers: workers})
}

func (b *bench) riverMigrate(ctx context.Context) error {
	for _, st := range []string{"DROP SCHEMA IF EXISTS " + riverSchema + " CASCADE", "CREATE SCHEMA " + riverSchema} {
		if _, err := b.pool.Exec(ctx, st); err != nil {
			return err
		}
	}
	m, err := rivermigrate.New(riverpgxv5.New(b.pool), &rivermigrate.Config{Schema: riverSchema, Logger: quietRiver})
	if err != nil {
		return err
	}
	_, err = m.Migrate(ctx, rivermigrate.DirectionUp, nil)
	return err
}

// riverLeader is River's current leader ("" if none), from its table.
func (b *bench) riverLeader(ctx context.Context) (string, error) {
	var id string
	err := b.pool.QueryRow(ctx, "SELECT leader_id FROM "+riverSchema+".river_leader WHERE expires_at > now()").Scan(&id)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	return id, err
}

// untilLeader polls River's leader table every 5 ms until id leads, and
// returns when it saw it.
func (b *bench) untilLeader(ctx context.Context, id string, limit time.Duration) (time.Time, error) {
	for deadline := time.Now().Add(limit); ; time.Sleep(5 * time.Millisecond) {
		got, err := b.riverLeader(ctx)
		if err != nil {
			return time.Time{}, err
		}
		if got == id {
			return time.Now(), nil
		}
		if time.Now().After(deadline) {
			return time.Time{}, fmt.Errorf("river: %s did not lead within %v (leader %q)", id, limit, got)
		}
	}
}

// countingPool is a pool of its own whose statements are counted.
func (b *bench) countingPool(ctx context.Context, conns int32) (*pgxpool.Pool, *counter, error) {
	cfg, err := pgxpool.ParseConfig(b.url)
	if err != nil {
		return nil, nil, err
	}
	cfg.MaxConns = conns
	c := &counter{}
	cfg.ConnConfig.Tracer = c
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	return p, c, err
}

// electionRow is one line of the elector table.
type electionRow struct {
	system, timings              string
	graceful, killed, statements []float64
}

func (b *bench) river(ctx context.Context, out *bytes.Buffer, rounds int, window time.Duration) error {
	if err := b.riverMigrate(ctx); err != nil {
		return fmt.Errorf("river: migrate: %w", err)
	}
	rows := []*electionRow{{system: "River's elector (`river.Client`)", timings: "River's, fixed: elect every 5 s (+ up to 1 s jitter), leader TTL 15 s"}}
	if err := b.riverRounds(ctx, rows[0], rounds, window); err != nil {
		return err
	}
	for _, poll := range []time.Duration{time.Second, 5 * time.Second} {
		r := &electionRow{system: "pgfence `lock.Election`", timings: fmt.Sprintf("TTL 15 s, PollInterval %v", poll)}
		if poll == time.Second {
			r.timings += " (the defaults)"
		} else {
			r.timings += " (River's)"
		}
		if err := b.electionRounds(ctx, r, poll, rounds, window); err != nil {
			return err
		}
		rows = append(rows, r)
	}
	fmt.Fprintf(out, "\n### Leader election side by side with River\n\nTwo clients of each, one leading. Graceful: the leader stops "+
		"(River: `Client.Stop`; pgfence: `Election.Run`'s context cancelled) and the other leads (River: its row in `river_leader`, "+
		"polled every 5 ms; pgfence: its `Lead` called). Killed: the leader is a child process, SIGKILLed. Statements: what the "+
		"waiting client's own pool sent per second over %s while the other led (River: the whole client, which also fetches jobs "+
		"and heartbeats its producer; pgfence: its Election's client). %d rounds.\n\n"+
		"| elector | timings | graceful stop to the next leader, ms | SIGKILL to the next leader, s | statements/s while waiting |\n|---|---|---|---|---|\n",
		window, rounds)
	for _, r := range rows {
		fmt.Fprintf(out, "| %s | %s | %s | %s | %s |\n", r.system, r.timings, summary(r.graceful, "%.0f"), summary(r.killed, "%.1f"), summary(r.statements, "%.1f"))
	}
	return nil
}

// riverRounds measures River's elector: graceful handovers between two
// in-process clients, then a SIGKILLed child leader, rounds times each.
func (b *bench) riverRounds(ctx context.Context, row *electionRow, rounds int, window time.Duration) error {
	pool, sent, err := b.countingPool(ctx, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	for i := range rounds {
		leader, err := newRiver(b.pool, fmt.Sprintf("river-a-%d", i))
		if err != nil {
			return err
		}
		if err := leader.Start(ctx); err != nil {
			return err
		}
		if _, err := b.untilLeader(ctx, fmt.Sprintf("river-a-%d", i), 30*time.Second); err != nil {
			return err
		}
		waiter, err := newRiver(pool, fmt.Sprintf("river-b-%d", i))
		if err != nil {
			return err
		}
		if err := waiter.Start(ctx); err != nil {
			return err
		}
		time.Sleep(time.Second) // the waiter is started and waiting
		before := sent.statements.Load()
		time.Sleep(window)
		row.statements = append(row.statements, float64(sent.statements.Load()-before)/window.Seconds())
		stopped := time.Now()
		if err := leader.Stop(ctx); err != nil {
			return err
		}
		at, err := b.untilLeader(ctx, fmt.Sprintf("river-b-%d", i), 30*time.Second)
		if err != nil {
			return err
		}
		row.graceful = append(row.graceful, float64(at.Sub(stopped).Microseconds())/1000)
		if err := waiter.Stop(ctx); err != nil {
			return err
		}
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	for i := range rounds {
		id := fmt.Sprintf("river-child-%d", i)
		cmd, _, err := startChild(ctx, exe, "-river-child", id, "-database-url", b.url)
		if err != nil {
			return err
		}
		if _, err := b.untilLeader(ctx, id, 30*time.Second); err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return err
		}
		waiter, err := newRiver(b.pool, fmt.Sprintf("river-w-%d", i))
		if err != nil {
			return err
		}
		if err := waiter.Start(ctx); err != nil {
			return err
		}
		time.Sleep(time.Second)
		killed := time.Now()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		at, err := b.untilLeader(ctx, fmt.Sprintf("river-w-%d", i), time.Minute)
		if err != nil {
			return err
		}
		row.killed = append(row.killed, at.Sub(killed).Seconds())
		if err := waiter.Stop(ctx); err != nil {
			return err
		}
	}
	return nil
}

// startChild starts the bench binary in a child mode and waits for its
// first line (it holds what it was asked to), which it returns.
func startChild(ctx context.Context, exe string, args ...string) (*exec.Cmd, string, error) {
	cmd := exec.CommandContext(ctx, exe, args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, "", fmt.Errorf("child %v: %w", args, err)
	}
	return cmd, line, nil
}

// riverChildFlag is the hidden flag of the River child.
func riverChildFlag() *string {
	return flag.String("river-child", "", "internal: run a River client with this id until killed")
}

// riverChild runs a River client with id, says so, and waits to be killed.
func riverChild(ctx context.Context, dbURL, id string) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	c, err := newRiver(pool, id)
	if err != nil {
		return err
	}
	if err := c.Start(ctx); err != nil {
		return err
	}
	fmt.Println("started")
	select {}
}

// electionRounds measures pgfence's Election the same way: graceful
// handovers in process, then a SIGKILLed child holding the lease (the
// crash child, TTL 15 s) while an Election waits.
func (b *bench) electionRounds(ctx context.Context, row *electionRow, poll time.Duration, rounds int, window time.Duration) error {
	pool, sent, err := b.countingPool(ctx, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	const ttl = 15 * time.Second
	elect := func(p *pgxpool.Pool, name, who string, led chan<- time.Time) (stop func(), err error) {
		c, err := lock.New(p, lock.Config{Schema: schema, TTL: ttl, PollInterval: poll, Holder: who, Logger: quiet})
		if err != nil {
			return nil, err
		}
		ectx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		e := &lock.Election{Client: c, Name: name, Lead: func(ctx context.Context, _ *lock.Lease) error {
			led <- time.Now()
			<-ctx.Done()
			return nil
		}}
		go func() { defer close(done); _ = e.Run(ectx) }()
		return func() { cancel(); <-done; _ = c.Close(context.Background()) }, nil
	}
	for i := range rounds {
		name := fmt.Sprintf("bench-elect-%v-%d", poll, i)
		aLed, bLed := make(chan time.Time, 1), make(chan time.Time, 1)
		stopA, err := elect(b.pool, name, "elect-a", aLed)
		if err != nil {
			return err
		}
		<-aLed
		stopB, err := elect(pool, name, "elect-b", bLed)
		if err != nil {
			stopA()
			return err
		}
		time.Sleep(time.Second)
		before := sent.statements.Load()
		time.Sleep(window)
		row.statements = append(row.statements, float64(sent.statements.Load()-before)/window.Seconds())
		stopped := time.Now()
		stopA()
		at := <-bLed
		row.graceful = append(row.graceful, float64(at.Sub(stopped).Microseconds())/1000)
		stopB()
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	for i := range rounds {
		name := fmt.Sprintf("bench-elect-crash-%v-%d", poll, i)
		cmd, _, err := startChild(ctx, exe, "-crash-child", name, "-crash-ttl", ttl.String(), "-database-url", b.url)
		if err != nil {
			return err
		}
		led := make(chan time.Time, 1)
		stop, err := elect(b.pool, name, "elect-w", led)
		if err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return err
		}
		time.Sleep(time.Second)
		killed := time.Now()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		select {
		case at := <-led:
			row.killed = append(row.killed, at.Sub(killed).Seconds())
		case <-time.After(time.Minute):
			stop()
			return fmt.Errorf("election: no leader within a minute of the kill")
		}
		stop()
	}
	return nil
}
