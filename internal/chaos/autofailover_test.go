package chaos

import (
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/autofailover"
	"github.com/pgfence/pgfence/internal/pgcluster"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// TestAutoFailoverFailovers runs pgfence on a real pg_auto_failover
// formation (a monitor, a primary and a secondary) through a double
// failover, while an Election campaigns and writes throughout: a failover
// the monitor is asked for (n1 to n2), then, once n1 follows n2, a crash of
// n2 (back to n1), then n2 rejoins. Checked: every token after each
// promotion is above every token seen before it, none is issued twice, the
// resource fence never admits one token for two acquisitions nor a lower
// token after a higher, no guarded write commits out of order, the
// Election never gives up, and a leader writes again within the monitor's
// unhealthy and demote timeouts + the lease TTL + slack (the longest gap
// between the leader's writes around each failover is logged: how long
// there was no leader).
func TestAutoFailoverFailovers(t *testing.T) {
	ctx := pgtest.Context(t, 8*time.Minute)
	fc, err := autofailover.Start(ctx)
	pgtest.NeedTool(t, err, autofailover.ErrMissing, pgcluster.ErrNoServer)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range fc.Nodes() {
				t.Logf("%s's keeper log tail:\n%s", n.Name, n.Logs())
			}
		}
		_ = fc.Close()
	})
	r, admin := newHARig(t, ctx, fc.URL(), autofailover.UnhealthyAfter+autofailover.DemoteTimeout+10*time.Second)
	el := r.elect()
	defer el.stop()
	steps := r.client("steps", pgtest.Quiet)
	r.churn(steps, "step", 5)
	el.back("start", time.Time{})
	primary := func() *autofailover.Node {
		t.Helper()
		n, err := fc.WaitPrimary(ctx, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	var gaps []time.Duration

	t.Log("--- failover asked of the monitor")
	old := primary()
	before := r.maxIssued()
	began := time.Now()
	if err := fc.Failover(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := fc.WaitPrimary(ctx, 60*time.Second, old); err != nil {
		t.Fatal(err)
	}
	l := r.acquireAfterFailover(steps, "step", before)
	done := time.Now()
	el.back("after the failover", done)
	gaps = append(gaps, r.longestGap(began, done))
	_ = l.Release(ctx)
	if err := fc.WaitSettled(ctx, 120*time.Second); err != nil {
		t.Fatal(err)
	}
	r.churn(steps, "step", 5)

	t.Log("--- crash of the new primary (the second failover)")
	old = primary()
	before = r.maxIssued()
	began = time.Now()
	if err := old.Crash(); err != nil {
		t.Fatal(err)
	}
	if _, err := fc.WaitPrimary(ctx, r.bound+30*time.Second, old); err != nil {
		t.Fatal(err)
	}
	l = r.acquireAfterFailover(steps, "step", before)
	done = time.Now()
	el.back("crash", began)
	gaps = append(gaps, r.longestGap(began, done))
	_ = l.Release(ctx)

	t.Log("--- the crashed node rejoins")
	if err := old.Start(); err != nil {
		t.Fatal(err)
	}
	if err := fc.WaitSettled(ctx, 120*time.Second); err != nil {
		t.Fatal(err)
	}
	before = r.maxIssued()
	r.churn(steps, "step", 5)
	if r.maxIssued() <= before {
		t.Fatalf("after the rejoin: tokens up to %d, not above %d", r.maxIssued(), before)
	}
	el.goesOn("rejoin")
	if err := el.stop(); err != nil {
		t.Fatalf("Election.Run: %v", err)
	}
	n, admitted := r.checkHistory(admin)
	msgs := r.checkWarnings(2)
	t.Logf("pg_auto_failover: 2 failovers, %d acquisitions, %d resource-fenced writes; no leader for %v (asked) and %v (crash); the election's warnings: %v",
		n, admitted, gaps[0].Round(100*time.Millisecond), gaps[1].Round(100*time.Millisecond), msgs)
}
