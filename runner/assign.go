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
