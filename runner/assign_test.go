package runner

import (
	"fmt"
	"slices"
	"testing"
)

func memberIDs(n int) []string {
	m := make([]string, n)
	for i := range m {
		m[i] = fmt.Sprintf("host-%d:%d", i, 1000+i)
	}
	return m
}

// owners maps shard -> owner id.
func owners(job string, shards int, ms []string) []string {
	idx := assign(job, shards, ms)
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

	// One of 8 leaves: its 128 shards must move; few others may.
	leave := owners("compact", shards, ms[1:])
	leaveMoves := moved(base, leave)
	// One joins (9): about 1/9 of the shards move to it.
	join := owners("compact", shards, memberIDs(9))
	joinMoves := moved(base, join)
	t.Logf("1,024 shards over 8: loads %d..%d; one leaves: %d moved (minimum 128); one joins: %d moved (minimum %d)",
		lo, hi, leaveMoves, joinMoves, shards/9)
	if leaveMoves > 2*128 || joinMoves > 2*(shards/9+1) {
		t.Fatalf("moves: leave %d, join %d; want about 1/n of the shards", leaveMoves, joinMoves)
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
	if got := assign("j", 4, nil); got != nil {
		t.Fatalf("no members: %v", got)
	}
	one := assign("j", 5, []string{"only"})
	for s, o := range one {
		if o != 0 {
			t.Fatalf("one member: shard %d -> %d", s, o)
		}
	}
	// More members than shards: each shard on a distinct member.
	few := assign("j", 3, memberIDs(8))
	if few[0] == few[1] || few[1] == few[2] || few[0] == few[2] {
		t.Fatalf("3 shards over 8 members share a member: %v", few)
	}
}
