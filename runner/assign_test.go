package runner

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func memberIDs(n int) []string {
	m := make([]string, n)
	for i := range m {
		m[i] = fmt.Sprintf("host-%d:%d", i, 1000+i)
	}
	return m
}

// owners maps shard -> owner id, from no holders.
func owners(job string, shards int, ms []string) []string { return ownersHeld(job, shards, ms, nil) }

// ownersHeld maps shard -> owner id when held[s] holds each shard now.
func ownersHeld(job string, shards int, ms []string, held []string) []string {
	idx := assign(job, shards, ms, held)
	out := make([]string, shards)
	for s, i := range idx {
		out[s] = ms[i]
	}
	return out
}

func moved(a, b []string) int {
	n := 0
	for s := range a {
		if a[s] != b[s] {
			n++
		}
	}
	return n
}

// 1,024 shards over 8 instances are balanced, every instance
// computes the same assignment whatever the order it lists the members in,
// and a membership change moves few shards.
func TestAssignBalancedStableAndMinimal(t *testing.T) {
	const shards = 1024
	ms := memberIDs(8)
	base := owners("compact", shards, ms)

	load := map[string]int{}
	for _, o := range base {
		load[o]++
	}
	lo, hi := shards, 0
	for _, m := range ms {
		lo, hi = min(lo, load[m]), max(hi, load[m])
	}
	if hi > 128 || lo < 128-8 {
		t.Fatalf("1,024 shards over 8: loads %d..%d, want close to 128", lo, hi)
	}

	rev := slices.Clone(ms)
	slices.Reverse(rev)
	if moved(base, owners("compact", shards, rev)) != 0 {
		t.Fatal("the assignment depends on the order of the members")
	}

	// One of 8 leaves: exactly its 128 shards move, the current holders
	// (base) keeping theirs.
	leave := ownersHeld("compact", shards, ms[1:], base)
	leaveMoves := moved(base, leave)
	// One joins (9): exactly the new member's share moves to it.
	join := ownersHeld("compact", shards, memberIDs(9), base)
	joinMoves := moved(base, join)
	// Without the holders (the plain hashing), more move.
	coldLeave, coldJoin := moved(base, owners("compact", shards, ms[1:])), moved(base, owners("compact", shards, memberIDs(9)))
	t.Logf("1,024 shards over 8: loads %d..%d; one leaves: %d moved (%d without the holders); one joins: %d moved (%d without)",
		lo, hi, leaveMoves, coldLeave, joinMoves, coldJoin)
	if leaveMoves != 128 || joinMoves > shards/9+1 {
		t.Fatalf("moves: leave %d (want 128), join %d (want at most %d)", leaveMoves, joinMoves, shards/9+1)
	}
	for s := range base {
		if base[s] != ms[0] && leave[s] == ms[0] {
			t.Fatalf("shard %d went to the member that left", s)
		}
	}

	// Formerly, shard s went to live[s mod n] for every job alike.
	zero := map[string]bool{}
	for j := range 16 {
		zero[owners(fmt.Sprintf("job-%d", j), 4, ms)[0]] = true
	}
	if len(zero) < 3 {
		t.Fatalf("shard 0 of 16 jobs lands on %d instances; want them spread", len(zero))
	}
}

func TestAssignEdgeCases(t *testing.T) {
	if got := assign("j", 4, nil, nil); got != nil {
		t.Fatalf("no members: %v", got)
	}
	one := assign("j", 5, []string{"only"}, nil)
	for s, o := range one {
		if o != 0 {
			t.Fatalf("one member: shard %d -> %d", s, o)
		}
	}
	// More members than shards: each shard on a distinct member.
	few := assign("j", 3, memberIDs(8), nil)
	if few[0] == few[1] || few[1] == few[2] || few[0] == few[2] {
		t.Fatalf("3 shards over 8 members share a member: %v", few)
	}
}

// Singleton jobs spread over the members with loads bounded across jobs:
// 100 jobs on 10 members lead at most 13 each; a join or a leave moves at most a fifth of them
// and a leave only the leaver's and a few more; the same view gives the
// same answer in any order; a job goes only to members that registered it.
func TestSpreadSingletons(t *testing.T) {
	ids := func(n int) []string {
		var s []string
		for i := range n {
			s = append(s, fmt.Sprintf("replica-%02d", i))
		}
		return s
	}
	var jobs []string
	for i := range 100 {
		jobs = append(jobs, fmt.Sprintf("job-%03d", i))
	}
	view := func(ids []string) members {
		v := members{}
		for _, j := range jobs {
			v[j] = slices.Sorted(slices.Values(ids))
		}
		return v
	}
	loads := func(owner map[string]string) map[string]int {
		l := map[string]int{}
		for _, o := range owner {
			l[o]++
		}
		return l
	}
	ten := spread(jobs, view(ids(10)))
	for id, n := range loads(ten) {
		if n > 13 {
			t.Fatalf("%s leads %d of 100 jobs on 10 members: %v", id, n, loads(ten))
		}
	}
	t.Logf("100 jobs on 10 members: %v", loads(ten))
	moved := func(a, b map[string]string) int {
		n := 0
		for j := range a {
			if a[j] != b[j] {
				n++
			}
		}
		return n
	}
	eleven := spread(jobs, view(ids(11)))
	if m := moved(ten, eleven); m > 20 {
		t.Fatalf("a join moved %d of 100 jobs", m)
	} else {
		t.Logf("a join moved %d, a leave %d", m, moved(ten, spread(jobs, view(ids(10)[1:]))))
	}
	if l := loads(eleven); l["replica-10"] < 8 {
		t.Fatalf("the member that joined leads %d jobs: %v", l["replica-10"], l)
	}
	nine := spread(jobs, view(ids(10)[1:]))
	if m := moved(ten, nine); m > 20 {
		t.Fatalf("a leave moved %d of 100 jobs", m)
	}
	for j, o := range nine {
		if o == "replica-00" {
			t.Fatalf("%s stays with the member that left", j)
		}
	}
	reversed := members{}
	for j, m := range view(ids(10)) {
		reversed[j] = slices.Clone(m)
		slices.Reverse(reversed[j])
	}
	if got := spread(slices.Clone(jobs), reversed); moved(ten, got) != 0 {
		t.Fatal("the same view in another order gives another answer")
	}
	// Two services: job-000..049 registered by a0..a4, the rest by b0..b4.
	mixed := members{}
	for i, j := range jobs {
		if i < 50 {
			mixed[j] = []string{"a0", "a1", "a2", "a3", "a4"}
		} else {
			mixed[j] = []string{"b0", "b1", "b2", "b3", "b4"}
		}
	}
	got := spread(jobs, mixed)
	for i, j := range jobs {
		if (i < 50) != strings.HasPrefix(got[j], "a") {
			t.Fatalf("%s goes to %s, which did not register it", j, got[j])
		}
	}
	for id, n := range loads(got) {
		if n > 13 {
			t.Fatalf("two services: %s leads %d: %v", id, n, loads(got))
		}
	}
}

// A replica joining a fleet of n moves at most ceil(N/n) + 1 of a consumer group's N
// partitions (and leaving, as many back), for every fleet and partition
// count up to 64 replicas and 256 partitions, and for several group names;
// the worst case found is logged.
func TestJoinMovesAtMostCeilNOverNPlusOne(t *testing.T) {
	worst, worstAt := 0.0, ""
	for _, role := range []string{"outbox-relay", "orders", "p"} {
		for n := 1; n <= 64; n++ {
			fleet := memberIDs(n + 1)
			for _, parts := range []int{1, 2, 3, 7, 8, 16, 31, 64, 100, 256} {
				was := owners(role, parts, fleet[:n])
				now := ownersHeld(role, parts, fleet, was)
				bound := (parts+n-1)/n + 1
				if m := moved(was, now); m > bound {
					t.Errorf("group %q, %d partitions: a join to %d replicas moved %d, bound %d", role, parts, n, m, bound)
				} else if r := float64(m) / float64(bound); r > worst {
					worst, worstAt = r, fmt.Sprintf("group %q, %d partitions, %d -> %d replicas: %d moved, bound %d", role, parts, n, n+1, m, bound)
				}
			}
		}
	}
	t.Logf("closest to the bound: %s", worstAt)
}
