package runner

import (
	"encoding/binary"
	"hash/fnv"
	"slices"
)

// assign returns, for each shard of job, the index in members of the
// instance that owns it. members are the live instances that registered the
// job; every instance computes the same answer from the same set, in any
// order.
//
// It is rendezvous (highest-random-weight) hashing with bounded loads: each
// shard ranks the members by a hash of (job, shard, member) and goes to the
// highest-ranked member that has fewer than ceil(shards/len(members)) shards
// already, shards taken in a fixed order. Plain rendezvous hashing moves only
// the shards of a member that joins or leaves (about 1/n) but leaves loads
// uneven (1,024 shards over 8 members: about 105 to 150); the bound caps
// every member at ceil(shards/n), and the members below the cap share what
// is left (1,024 over 7: six of 147 and one of 142), at the cost of a few
// more moves per change (BENCHMARKS.md). Hashing the job name in means that
// shard 0 of every job does not land on the same instance.
func assign(job string, shards int, members []string) []int {
	if len(members) == 0 {
		return nil
	}
	capacity := (shards + len(members) - 1) / len(members)
	load := make([]int, len(members))
	owner := make([]int, shards)
	rank := make([]int, len(members))
	weight := make([]uint64, len(members))
	for s := range shards {
		for m := range members {
			rank[m], weight[m] = m, score(job, s, members[m])
		}
		slices.SortFunc(rank, func(a, b int) int {
			switch {
			case weight[a] > weight[b]:
				return -1
			case weight[a] < weight[b]:
				return 1
			}
			return compareStrings(members[a], members[b])
		})
		for _, m := range rank {
			if load[m] < capacity {
				owner[s] = m
				load[m]++
				break
			}
		}
	}
	return owner
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
