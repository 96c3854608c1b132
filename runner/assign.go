package runner

import (
	"encoding/binary"
	"hash/fnv"
	"slices"
)

// assign returns, for each shard of job, the index in members of the
// instance that owns it. members are the live instances that registered the
// job; held[s] is the instance holding shard s's lease now ("" if none, or
// held nil when unknown). Every instance computes the same answer from the
// same members and holders, in any order.
//
// Loads are balanced: with shards = q*n + r over n members, r members own
// q+1 shards and the others q (the r are those holding the most now, then
// by a hash of the job and the member). Each member keeps as many of the
// shards it holds as its load allows (its highest-ranked first), and the
// rest go, shard by shard, to the highest-ranked member still below its
// load: rendezvous (highest-random-weight) hashing over a hash of (job,
// shard, member), restricted to the members with room. Hashing the job name
// in means that shard 0 of every job does not land on the same instance.
//
// Keeping what is held is what bounds the moves: when one member joins a
// fleet of n, the others give up only what brings them down to their new
// load, which is exactly what the new member takes (at most
// ceil(shards/(n+1))); when one leaves, only its shards move. A stateless
// assignment cannot do this: capping every member at ceil(shards/n) and
// filling in a fixed order moved up to 50 of 256 shards when a 64th member
// joined, as the lower cap cascaded through the order.
func assign(job string, shards int, members []string, held []string) []int {
	n := len(members)
	if n == 0 {
		return nil
	}
	index := make(map[string]int, n)
	for i, m := range members {
		index[m] = i
	}
	current := make([]int, n)
	holder := make([]int, shards) // the member holding each shard, or -1
	for s := range shards {
		holder[s] = -1
		if held != nil {
			if i, ok := index[held[s]]; ok {
				holder[s] = i
				current[i]++
			}
		}
	}
	// Loads: the r members holding the most get q+1.
	q, r := shards/n, shards%n
	order := make([]int, n)
	tie := make([]uint64, n)
	for i := range order {
		order[i], tie[i] = i, score(job, -1, members[i])
	}
	slices.SortFunc(order, func(a, b int) int {
		switch {
		case current[a] != current[b]:
			return current[b] - current[a]
		case tie[a] != tie[b]:
			if tie[a] > tie[b] {
				return -1
			}
			return 1
		}
		return compareStrings(members[a], members[b])
	})
	load := make([]int, n)
	for k, i := range order {
		load[i] = q
		if k < r {
			load[i]++
		}
	}
	owner := make([]int, shards)
	for s := range owner {
		owner[s] = -1
	}
	// Each member keeps its highest-ranked held shards, up to its load.
	kept := make([]int, n)
	byMember := make([][]int, n)
	for s, i := range holder {
		if i >= 0 {
			byMember[i] = append(byMember[i], s)
		}
	}
	for i, ss := range byMember {
		slices.SortFunc(ss, func(a, b int) int { return compareScores(score(job, a, members[i]), score(job, b, members[i]), a, b) })
		for _, s := range ss[:min(len(ss), load[i])] {
			owner[s] = i
			kept[i]++
		}
	}
	// The rest go to the highest-ranked member with room.
	for s := range shards {
		if owner[s] >= 0 {
			continue
		}
		best, bestScore := -1, uint64(0)
		for i := range members {
			if kept[i] >= load[i] {
				continue
			}
			if sc := score(job, s, members[i]); best < 0 || sc > bestScore || (sc == bestScore && members[i] < members[best]) {
				best, bestScore = i, sc
			}
		}
		owner[s] = best
		kept[best]++
	}
	return owner
}

// compareScores orders shards by descending score, then by number.
func compareScores(sa, sb uint64, a, b int) int {
	switch {
	case sa > sb:
		return -1
	case sa < sb:
		return 1
	}
	return a - b
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// score is the rendezvous weight of member for (job, shard): FNV-1a over
// the three, finished with splitmix64's mixer for an even spread.
func score(job string, shard int, member string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(job))
	var b [9]byte
	binary.BigEndian.PutUint64(b[1:], uint64(shard))
	h.Write(b[:])
	h.Write([]byte(member))
	x := h.Sum64()
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// spread returns, for each singleton job, the member that should lead it:
// the same rendezvous hashing over the live instances that registered the
// job (view), with the bound taken across all the jobs, so that each
// instance leads about its share: every member leads at most 1.25 times
// the mean (rounded up) when all register the same jobs, 13 of 100 jobs on
// 10. The slack keeps a join or leave from cascading: with the mean itself
// as the bound, a join moved 23 of those 100 jobs, with 1.25 times it 16
// (TestSpreadSingletons; the least possible is about 9).
// Jobs are placed in name order; a job whose every candidate is full goes
// to its highest-ranked one.
func spread(jobs []string, view members) map[string]string {
	distinct := map[string]bool{}
	for _, j := range jobs {
		for _, id := range view[j] {
			distinct[id] = true
		}
	}
	n := len(distinct)
	if n == 0 {
		return nil
	}
	capacity := (5*len(jobs) + 4*n - 1) / (4 * n) // ceil(1.25 x the mean)
	load := map[string]int{}
	out := make(map[string]string, len(jobs))
	for _, j := range slices.Sorted(slices.Values(jobs)) {
		ids := view[j]
		if len(ids) == 0 {
			continue
		}
		ranked := slices.Clone(ids)
		slices.SortFunc(ranked, func(a, b string) int {
			wa, wb := score(j, 0, a), score(j, 0, b)
			switch {
			case wa > wb:
				return -1
			case wa < wb:
				return 1
			}
			return compareStrings(a, b)
		})
		owner := ranked[0]
		for _, id := range ranked {
			if load[id] < capacity {
				owner = id
				break
			}
		}
		out[j] = owner
		load[owner]++
	}
	return out
}
