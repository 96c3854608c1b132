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

// Singleton jobs spread over replica processes.
const (
	spreadEnv  = "PGFENCE_SPREAD" // "schema instance": run as a replica with spreadJobs singleton jobs
	spreadJobs = 24
	spreadTTL  = 2 * time.Second
	spreadPoll = 100 * time.Millisecond // serviceRunner's PollInterval
)

func spreadReplica() int {
	s, err := newService(spreadEnv, spreadTTL, runner.Config{})
	if err != nil {
		return exit("spread", err)
	}
	defer s.close()
	for j := range spreadJobs {
		err = s.r.Register(runner.Job{Name: fmt.Sprintf("job-%02d", j), Schedule: "@every 500ms", Missed: runner.Skip,
			Run: func(ctx context.Context, run *runner.Run) error {
				return run.CommitTx(ctx, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, "INSERT INTO "+s.table("effects")+" VALUES ($1, $2, $3)", run.Job, run.Slot, s.id)
					return err
				})
			}})
		if err != nil {
			return exit("spread", err)
		}
	}
	return exit("spread", s.r.Run(s.ctx))
}

// 24 singleton jobs on four replica processes: each leads at most its
// bound (ceil(1.25 x 24/4) = 8) once leadership has settled; a SIGKILLed
// replica's jobs are taken over within about a TTL (its liveness row and
// the leases expire; + slack for this machine); a graceful leave hands its jobs over at once; a replica that
// joins takes a share; no slot runs twice.
func TestSingletonsSpreadOverReplicas(t *testing.T) {
	db := pgtest.New(t)
	ctx := pgtest.Context(t, 3*time.Minute)
	effects := tbl(db, "effects")
	mustExec(t, db, "CREATE TABLE "+effects+" (job text, slot timestamptz, instance text)")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	procs := map[string]*exec.Cmd{}
	launch := func(id string) {
		cmd := exec.Command(exe)
		cmd.Env = append(os.Environ(), spreadEnv+"="+db.Schema+" "+id)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs[id] = cmd
	}
	t.Cleanup(func() {
		for _, cmd := range procs {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	// leads maps each live holder to the jobs it leads.
	leads := func() (map[string][]string, int) {
		rows, err := db.Pool.Query(ctx, "SELECT holder, name FROM "+tbl(db, "pgfence_lease_states")+
			" WHERE name LIKE 'pgfence/job/job-%' AND holder IS NOT NULL AND expires_at > now() ORDER BY holder, name")
		if err != nil {
			t.Fatal(err)
		}
		m, n := map[string][]string{}, 0
		for rows.Next() {
			var h, name string
			if err := rows.Scan(&h, &name); err != nil {
				t.Fatal(err)
			}
			m[h] = append(m[h], name)
			n++
		}
		return m, n
	}
	// settled waits until every job is led and the leadership has held
	// still for two RebalanceIntervals, and checks the bound.
	settled := func(what string, replicas int) map[string][]string {
		t.Helper()
		var last string
		since := time.Now()
		var m map[string][]string
		waitFor(t, 60*time.Second, what+": leadership to settle", func() bool {
			var n int
			m, n = leads()
			key := fmt.Sprint(m)
			if key != last || n != spreadJobs {
				last, since = key, time.Now()
			}
			return time.Since(since) > spreadTTL
		})
		bound := (5*spreadJobs + 4*replicas - 1) / (4 * replicas)
		counts := map[string]int{}
		for h, jobs := range m {
			counts[h] = len(jobs)
			if len(jobs) > bound {
				t.Errorf("%s: %s leads %d jobs, above the bound %d: %v", what, h, len(jobs), bound, counts)
			}
		}
		t.Logf("%s: jobs led per replica %v (bound %d)", what, counts, bound)
		return m
	}
	for _, id := range []string{"r0", "r1", "r2", "r3"} {
		launch(id)
	}
	m := settled("start of 4", 4)

	// SIGKILL the replica leading the most.
	victim := ""
	for h, jobs := range m {
		if victim == "" || len(jobs) > len(m[victim]) {
			victim = h
		}
	}
	orphans := m[victim]
	killed := time.Now()
	_ = procs[victim].Process.Kill()
	_ = procs[victim].Wait()
	delete(procs, victim)
	waitFor(t, 30*time.Second, "the killed replica's jobs to be taken over", func() bool {
		m, _ := leads()
		taken := 0
		for h, jobs := range m {
			if h != victim {
				for _, j := range jobs {
					for _, o := range orphans {
						if j == o {
							taken++
						}
					}
				}
			}
		}
		return taken == len(orphans)
	})
	took := time.Since(killed)
	if limit := spreadTTL + time.Second; took > limit {
		t.Errorf("the %d jobs of the SIGKILLed %s were taken over after %v; want within TTL + 1s slack = %v",
			len(orphans), victim, took, limit)
	}
	t.Logf("SIGKILL of %s: its %d jobs taken over after %v (TTL %v, PollInterval %v)", victim, len(orphans), took.Round(time.Millisecond),
		spreadTTL, spreadPoll)
	m = settled("after the SIGKILL", 3)

	// A graceful leave.
	var leaver string
	for h := range m {
		leaver = h
		break
	}
	left := time.Now()
	_ = procs[leaver].Process.Signal(syscall.SIGTERM)
	if err := procs[leaver].Wait(); err != nil {
		t.Errorf("%s did not stop cleanly: %v", leaver, err)
	}
	delete(procs, leaver)
	waitFor(t, 30*time.Second, "the leaver's jobs to be taken over", func() bool {
		_, n := leads()
		return n == spreadJobs
	})
	t.Logf("graceful leave of %s: its %d jobs led again after %v", leaver, len(m[leaver]), time.Since(left).Round(time.Millisecond))
	if d := time.Since(left); d > spreadTTL {
		t.Errorf("a graceful leave took %v to hand over, more than a TTL", d)
	}
	settled("after the leave", 2)

	// A replica joins.
	launch("r4")
	m = settled("after r4 joined", 3)
	if len(m["r4"]) == 0 {
		t.Errorf("r4 joined and leads none of the %d jobs: %v", spreadJobs, m)
	}
	if dup := queryInt(t, db, "SELECT count(*) FROM (SELECT 1 FROM "+effects+" GROUP BY job, slot HAVING count(*) > 1) d"); dup != 0 {
		t.Fatalf("%d slots ran twice", dup)
	}
}
