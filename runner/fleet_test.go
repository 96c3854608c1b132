package runner_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/runner"
)

// The fleet: two services share one schema, each with its own sharded job.
const (
	fleetEnv    = "PGFENCE_FLEET"        // "schema instance job": run as a service process
	fleetShards = 8                      // per job
	fleetSlot   = 200 * time.Millisecond // each shard's schedule
	fleetTTL    = 2 * time.Second
)

// fleetMember is a service process: it runs one sharded job until SIGTERM,
// recording each run's effect in the same transaction as its success.
func fleetMember() int {
	s, err := newService(fleetEnv, fleetTTL, runner.Config{RebalanceInterval: 300 * time.Millisecond})
	if err != nil {
		return exit("fleet", err)
	}
	defer s.close()
	job := s.args[0]
	err = s.r.RegisterSharded(runner.Job{Name: job, Schedule: "@every " + fleetSlot.String(), Run: func(ctx context.Context, run *runner.Run) error {
		return run.CommitTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+s.table("effects")+" VALUES ($1, $2, $3, $4)", run.Job, run.Shard, run.Slot, s.id)
			return err
		})
	}}, fleetShards)
	if err == nil {
		err = s.r.Run(s.ctx)
	}
	return exit("fleet", err)
}

// Two services with different sharded jobs share a
// schema (service A: 3 processes, service B: 2); then a rolling restart of
// A, then a SIGKILL of one of B. After each change the fleet converges
// (every shard of both jobs runs again), and in each steady window every
// one of the 16 shards runs; no (job, shard, slot) ever succeeds twice, and
// the effects match the ledger one to one. Formerly, a quarter to half of
// such a fleet's shards never ran.
func TestFleet(t *testing.T) {
	db := pgtest.New(t)
	ctx := pgtest.Context(t, 3*time.Minute)
	mustExec(t, db, "CREATE TABLE "+tbl(db, "effects")+" (job text, shard int, slot timestamptz, instance text)")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	procs := map[string]*exec.Cmd{}
	launch := func(job, id string) {
		cmd := exec.Command(exe)
		cmd.Env = append(os.Environ(), fleetEnv+"="+db.Schema+" "+id+" "+job)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs[id] = cmd
	}
	stopProc := func(id string, sig syscall.Signal) {
		_ = procs[id].Process.Signal(sig)
		err := procs[id].Wait()
		if sig == syscall.SIGTERM && err != nil {
			t.Errorf("%s did not stop cleanly: %v", id, err)
		}
		delete(procs, id)
	}
	t.Cleanup(func() {
		for id := range procs {
			stopProc(id, syscall.SIGKILL)
		}
	})
	// ranSince counts the (job, shard) pairs with a success for a slot at
	// or after since (and before until, if set).
	ranSince := func(since, until time.Time) int {
		var n int
		if err := db.Pool.QueryRow(ctx, "SELECT count(DISTINCT (job, shard)) FROM "+tbl(db, "effects")+
			" WHERE slot >= $1 AND ($2::timestamptz IS NULL OR slot < $2)", since, nullTime(until)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	converge := func(what string, since time.Time) {
		t.Helper()
		waitFor(t, 30*time.Second, what, func() bool { return ranSince(since, time.Time{}) == 2*fleetShards })
		t.Logf("%s: every shard of both jobs ran again %v after the change", what, time.Since(since).Round(10*time.Millisecond))
	}
	steady := func(what string) {
		t.Helper()
		from := time.Now()
		time.Sleep(2 * time.Second)
		if n := ranSince(from, time.Now().Add(-fleetSlot)); n != 2*fleetShards {
			t.Errorf("steady window after %s: %d of %d shards ran", what, n, 2*fleetShards)
			rows, _ := db.Pool.Query(ctx, `SELECT l.name, coalesce(l.holder, '-'), l.expires_at > now(),
				(SELECT max(slot)::text FROM `+tbl(db, "effects")+` e WHERE 'pgfence/job/' || e.job || '/' || e.shard = l.name),
				(SELECT string_agg(status || '@' || slot::time::text, ' ' ORDER BY slot DESC) FROM (SELECT * FROM `+tbl(db, "pgfence_runs")+` r
				  WHERE 'pgfence/job/' || r.job || '/' || r.shard = l.name ORDER BY slot DESC LIMIT 3) x)
				FROM `+tbl(db, "pgfence_lease_states")+` l ORDER BY 1`)
			for rows.Next() {
				var name, holder string
				var live bool
				var last, runs *string
				_ = rows.Scan(&name, &holder, &live, &last, &runs)
				t.Logf("  %s holder=%s live=%v last_effect=%v runs=%v", name, holder, live, deref(last), deref(runs))
			}
			rows.Close()
		}
	}

	start := time.Now()
	for _, id := range []string{"a1", "a2", "a3"} {
		launch("svc-a", id)
	}
	for _, id := range []string{"b1", "b2"} {
		launch("svc-b", id)
	}
	converge("start of 5 processes", start)
	steady("start")

	for i, id := range []string{"a1", "a2", "a3"} { // rolling restart of A
		change := time.Now()
		stopProc(id, syscall.SIGTERM)
		launch("svc-a", fmt.Sprintf("a%d-v2", i+1))
		converge("rolling restart of "+id, change)
	}
	steady("rolling restart")

	change := time.Now()
	stopProc("b1", syscall.SIGKILL)
	converge("SIGKILL of b1", change)
	steady("SIGKILL")

	for id := range procs {
		stopProc(id, syscall.SIGTERM)
	}
	if dup := queryInt(t, db, "SELECT count(*) FROM (SELECT 1 FROM "+tbl(db, "effects")+
		" GROUP BY job, shard, slot HAVING count(*) > 1) d"); dup != 0 {
		t.Fatalf("%d (job, shard, slot) succeeded twice", dup)
	}
	diff := queryInt(t, db, `SELECT count(*) FROM (
		(SELECT job, shard, slot FROM `+tbl(db, "pgfence_runs")+` WHERE status = 'succeeded'
		 EXCEPT ALL SELECT job, shard, slot FROM `+tbl(db, "effects")+`)
		UNION ALL
		(SELECT job, shard, slot FROM `+tbl(db, "effects")+`
		 EXCEPT ALL SELECT job, shard, slot FROM `+tbl(db, "pgfence_runs")+` WHERE status = 'succeeded')) d`)
	if diff != 0 {
		t.Fatalf("ledger and effects differ by %d rows", diff)
	}
	t.Logf("%d runs succeeded in all", queryInt(t, db, "SELECT count(*) FROM "+tbl(db, "effects")))
}

func nullTime(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

func deref(s *string) string {
	if s == nil {
		return "-"
	}
	return *s
}
