package runner_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/runner"
)

// A steered replica: a service process that runs the job "steered" and
// obeys commands on its stdin (run, pause, resume), as an admin endpoint of
// the service would.
const (
	steerEnv = "PGFENCE_STEER" // "schema instance": run as a steered replica
	steerTTL = time.Second
)

func steeredReplica() int {
	s, err := newService(steerEnv, steerTTL, runner.Config{})
	if err != nil {
		return exit("steer", err)
	}
	defer s.close()
	ctx, schema, id, pool, r := s.ctx, s.schema, s.id, s.pool, s.r
	err = r.Register(runner.Job{Name: "steered", Schedule: "@every 200ms", Run: func(ctx context.Context, run *runner.Run) error {
		// A manual run waits until the test opens the gate, which it does
		// once the first one's leader is frozen (SIGSTOP) in this wait.
		// The wait is on the process's context, not the run's: thawed, the
		// run goes on to attempt its commit, however late, and records how
		// that attempt ended.
		for run.Manual {
			var open bool
			if err := pool.QueryRow(s.ctx, "SELECT EXISTS (SELECT FROM "+s.table("gate")+")").Scan(&open); err != nil {
				return err
			}
			if open {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		err := run.CommitTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+s.table("effects")+" VALUES ($1, $2, $3, $4)", run.Manual, run.Slot, int64(run.Token), id)
			return err
		})
		if run.Manual {
			_, _ = pool.Exec(s.ctx, "INSERT INTO "+s.table("attempts")+" VALUES ($1, $2, $3, $4)",
				run.Slot, int64(run.Token), id, errors.Is(err, fence.ErrFenced))
		}
		return err
	}})
	if err != nil {
		return exit("steer", err)
	}
	go func() { // commands, one per line; each answered with one line
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			var err error
			switch cmd := in.Text(); cmd {
			case "run":
				var refs []runner.RunRef
				if refs, err = runner.RunNow(ctx, pool, schema, "steered", 0, id); err == nil {
					fmt.Println("ran", refs[0].Slot.Format(time.RFC3339Nano))
					continue
				}
			case "pause":
				err = runner.Pause(ctx, pool, schema, "steered", id)
			case "resume":
				err = runner.Resume(ctx, pool, schema, "steered")
			default:
				err = fmt.Errorf("unknown command %q", cmd)
			}
			if err != nil {
				fmt.Println("error", err)
			} else {
				fmt.Println("ok")
			}
		}
	}()
	return exit("steer", r.Run(ctx))
}

// replica is a steered replica process and the pipes to command it.
type replica struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

// send gives the replica a command and returns its answer.
func (p *replica) send(t *testing.T, cmd string) string {
	t.Helper()
	if _, err := fmt.Fprintln(p.in, cmd); err != nil {
		t.Fatal(err)
	}
	if !p.out.Scan() {
		t.Fatalf("no answer to %q", cmd)
	}
	return p.out.Text()
}

// Three replica processes. The job's leader is frozen (SIGSTOP) in the
// middle of a manual run; a replica that does not lead asks for five more
// runs while the leader is frozen and leadership moves; the leader is
// thawed. Every request runs exactly once, under the new leader's token;
// the frozen leader's attempt is fenced, in the ledger, and its late
// commit is refused; jobs status names the new leader. Then a pause asked
// on one replica is honoured by all, also by a new leader after the old
// one is killed; nothing runs while paused; resume continues.
func TestSteeringWithAFrozenLeader(t *testing.T) {
	db := pgtest.New(t)
	ctx := pgtest.Context(t, 3*time.Minute)
	runs, effects := tbl(db, "pgfence_runs"), tbl(db, "effects")
	mustExec(t, db, "CREATE TABLE "+effects+" (manual bool, slot timestamptz, token bigint, instance text, UNIQUE (manual, slot))")
	mustExec(t, db, "CREATE TABLE "+tbl(db, "gate")+" (open bool)") // manual runs wait for a row
	mustExec(t, db, "CREATE TABLE "+tbl(db, "attempts")+" (slot timestamptz, token bigint, instance text, fenced bool)")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	procs := map[string]*replica{}
	for _, id := range []string{"r0", "r1", "r2"} {
		cmd := exec.Command(exe)
		cmd.Env = append(os.Environ(), steerEnv+"="+db.Schema+" "+id)
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs[id] = &replica{cmd: cmd, in: in, out: bufio.NewScanner(out)}
	}
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, p := range procs {
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
			_ = p.cmd.Process.Kill()
			_ = p.cmd.Wait()
		}
	})
	leaderNow := func() (string, int64) {
		jobs, err := runner.Jobs(ctx, db.Pool, db.Schema, "steered")
		if err != nil || len(jobs) > 1 {
			t.Fatalf("Jobs: %v, %v", jobs, err)
		}
		if len(jobs) == 0 {
			return "", 0 // no replica has registered the job yet
		}
		return jobs[0].Leader, int64(jobs[0].Token)
	}
	waitFor(t, 20*time.Second, "a leader and a few slots", func() bool {
		l, _ := leaderNow()
		return l != "" && queryInt(t, db, "SELECT count(*) FROM "+effects+" WHERE NOT manual") >= 3
	})
	// Leadership settles (the replicas hand the job to its preferred one).
	var stableSince time.Time
	var lastLeader string
	waitFor(t, 20*time.Second, "the leader to hold still for a second", func() bool {
		l, _ := leaderNow()
		if l != lastLeader || l == "" {
			lastLeader, stableSince = l, time.Now()
		}
		return time.Since(stableSince) > time.Second
	})
	var asker string
	for id := range procs {
		if id != lastLeader {
			asker = id
			break
		}
	}
	slotOf := func(answer string) time.Time {
		t.Helper()
		s, ok := strings.CutPrefix(answer, "ran ")
		at, err := time.Parse(time.RFC3339Nano, s)
		if !ok || err != nil {
			t.Fatalf("answer %q to run: %v", answer, err)
		}
		return at
	}
	// The first request reaches the leader, which is frozen mid-run.
	first := slotOf(procs[asker].send(t, "run"))
	waitFor(t, 10*time.Second, "the leader to start the manual run", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE kind = 'manual' AND status = 'running' AND slot = $1", first) == 1
	})
	// Freeze the replica running it, whichever that is.
	var frozen string
	var frozenToken int64
	if err := db.Pool.QueryRow(ctx, "SELECT holder, token FROM "+runs+" WHERE kind = 'manual' AND status = 'running' AND slot = $1",
		first).Scan(&frozen, &frozenToken); err != nil {
		t.Fatal(err)
	}
	if frozen == asker {
		t.Fatalf("the replica asking, %s, leads the job", asker)
	}
	if err := procs[frozen].cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	mustExec(t, db, "INSERT INTO "+tbl(db, "gate")+" VALUES (true)") // the frozen run goes on only once thawed
	slots := []time.Time{first}
	for range 4 {
		slots = append(slots, slotOf(procs[asker].send(t, "run")))
		time.Sleep(150 * time.Millisecond) // spread over the handover
	}
	waitFor(t, 20*time.Second, "every request to succeed under a new leader", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE kind = 'manual' AND status = 'succeeded'") == len(slots)
	})
	if err := procs[frozen].cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// The thawed leader finishes its run: it attempts its commit, which is
	// refused, and the ledger records its attempt as fenced.
	waitFor(t, 10*time.Second, "the frozen leader's commit attempt", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "attempts")+" WHERE slot = $1 AND token = $2 AND instance = $3",
			first, frozenToken, frozen) == 1
	})
	if n := queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "attempts")+" WHERE slot = $1 AND token = $2 AND instance = $3 AND fenced",
		first, frozenToken, frozen); n != 1 {
		t.Fatal("the frozen leader's late commit was not refused as fenced (fence.ErrFenced)")
	}
	waitFor(t, 10*time.Second, "the frozen leader's attempt to be fenced in the ledger", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE kind = 'manual' AND slot = $1 AND status = 'fenced' AND token = $2 AND holder = $3",
			first, frozenToken, frozen) == 1
	})
	for _, at := range slots {
		var tok int64
		var who string
		if err := db.Pool.QueryRow(ctx, "SELECT token, instance FROM "+effects+" WHERE manual AND slot = $1", at).Scan(&tok, &who); err != nil {
			t.Fatalf("the effect of the run asked at %v: %v", at, err)
		}
		if who == frozen || tok <= frozenToken {
			t.Fatalf("the run asked at %v committed on %s with token %d; the frozen leader %s had %d", at, who, tok, frozen, frozenToken)
		}
	}
	if n := queryInt(t, db, "SELECT count(*) FROM "+effects+" WHERE manual"); n != len(slots) {
		t.Fatalf("%d manual effects for %d requests", n, len(slots))
	}
	if n := queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE kind = 'manual' AND status = 'succeeded' AND requested_by = $1", asker); n != len(slots) {
		t.Fatalf("%d manual successes recorded as asked by %s, want %d", n, asker, len(slots))
	}
	// Jobs status names a leader with a newer term than the frozen one's
	// (the thawed replica may lead again, in a new term, if it is the
	// job's preferred replica).
	var leader string
	waitFor(t, 10*time.Second, "jobs status to name a leader in a newer term", func() bool {
		l, tok := leaderNow()
		leader = l
		return l != "" && tok > frozenToken
	})

	// Pause, asked on a replica that does not lead.
	var pauser string
	for id := range procs {
		if id != leader {
			pauser = id
			break
		}
	}
	if a := procs[pauser].send(t, "pause"); a != "ok" {
		t.Fatalf("pause: %s", a)
	}
	waitFor(t, 10*time.Second, "slots to be skipped", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE status = 'skipped'") >= 2
	})
	mu.Lock()
	_ = procs[leader].cmd.Process.Kill()
	_ = procs[leader].cmd.Wait()
	delete(procs, leader)
	mu.Unlock()
	waitFor(t, 20*time.Second, "the next leader to skip slots too", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE status = 'skipped' AND holder <> $1", leader) >= 2
	})
	if n := queryInt(t, db, "SELECT count(*) FROM "+runs+" r, "+tbl(db, "pgfence_jobs")+` j
		WHERE r.kind = 'scheduled' AND r.status <> 'skipped' AND r.started_at > j.paused_at + interval '50 milliseconds'`); n != 0 {
		t.Fatalf("%d scheduled attempts started while paused", n)
	}
	if a := procs[pauser].send(t, "resume"); a != "ok" {
		t.Fatalf("resume: %s", a)
	}
	resumed := time.Now()
	waitFor(t, 10*time.Second, "a slot to run after resume", func() bool {
		return queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE kind = 'scheduled' AND status = 'succeeded' AND started_at > $1", resumed) >= 1
	})
	if dup := queryInt(t, db, "SELECT count(*) FROM (SELECT 1 FROM "+runs+
		" WHERE status = 'succeeded' GROUP BY job, shard, kind, slot HAVING count(*) > 1) d"); dup != 0 {
		t.Fatalf("%d slots succeeded twice", dup)
	}
	t.Logf("frozen leader %s (token %d); requests from %s; new leader %s; %d manual runs, %d skipped while paused", frozen, frozenToken,
		asker, leader, len(slots), queryInt(t, db, "SELECT count(*) FROM "+runs+" WHERE status = 'skipped'"))
}
