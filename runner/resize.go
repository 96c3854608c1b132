package runner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/lock"
)

// ErrGroupChanging is returned by SetPartitions while another change of
// the group's partition count is under way.
var ErrGroupChanging = errors.New("runner: the consumer group's partition count is already changing")

// SetPartitions changes group's partition count in schema ("" means
// "pgfence") to n (1 to 65536). by says who changed it. It returns the
// count before, ErrUnknownJob for a group no runner registered, and
// ErrGroupChanging while another change is under way (asking for the
// change under way again returns at once).
//
// With no replica running the group, the count changes at once: partitions
// below n keep their offsets, partitions added start at 0, and the offsets
// of partitions dropped stay in the schema, led by nobody.
//
// With replicas running, the change goes through a cut, so that every
// item is consumed once and in order per key, without stopping them. The
// offsets of a group's partitions must then be positions in one sequence
// that all of them read (an outbox's transaction ids: the partition of an
// item is derived from its key and Partition.Partitions, by the consumer):
//
//  1. SetPartitions takes the cut: the highest committed offset of the
//     current partitions (a Commit under way finishes first). From then on
//     each current partition consumes below the cut only
//     (Partition.Until; a Commit past it is refused with
//     ErrOffsetPastUntil) and commits the cut once nothing below it can
//     still arrive.
//  2. When every current partition has committed the cut, a replica's
//     runner switches the count: the leases of the current partitions
//     are revoked (lock.RevokeTx: their leaders' commits are refused from
//     then on), every partition of the new count starts at the cut with
//     Partition.Partitions n, and the replicas take them at once.
//
// Replicas keep leading every partition throughout; the switch is a
// handover of all of them at once. A replica registered with the old count
// or the new one may start while the change is under way; afterwards,
// only with the new one (ErrPartitionCount). Groups (`pgfence groups`)
// shows a change under way and how many partitions have reached its cut.
func SetPartitions(ctx context.Context, db fence.DB, schema, group string, n int, by string) (before int, err error) {
	if err := ctxcheck.NotNil(ctx, "runner: SetPartitions"); err != nil {
		return 0, err
	}
	if err := pgexec.NotNil(db, "runner: SetPartitions"); err != nil {
		return 0, err
	}
	if err := (Consumer{Group: group, Partitions: n, Consume: func(context.Context, *Partition) error { return nil }}).validate(); err != nil {
		return 0, err
	}
	q, err := control(schema, group)
	if err != nil {
		return 0, err
	}
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var (
			next     int
			cut      int64
			changeBy string
		)
		if err := tx.QueryRow(ctx, q.lockGroup, group).Scan(&before, &next, &cut, &changeBy); err != nil {
			return err
		}
		switch {
		case next == n:
			return nil // asked again
		case next != 0:
			return fmt.Errorf("%w: to %d partitions at offset %d (asked by %s); it ends when every partition has reached the cut",
				ErrGroupChanging, next, cut, changeBy)
		case n == before:
			return nil
		}
		var live []string
		if err := tx.QueryRow(ctx, q.liveMembers, groupLeasePrefix+group).Scan(&live); err != nil {
			return err
		}
		if len(live) == 0 {
			_, err := tx.Exec(ctx, q.setCount, group, n, orUnknown(by))
			return err
		}
		if _, err := tx.Exec(ctx, q.createOffsets, group, before); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, q.cutAt, group, before).Scan(&cut); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, q.setCut, group, before, cut, n, orUnknown(by)); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, q.groupAnnounce, group, before, groupWakePrefix, membersName)
		return err
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return 0, fmt.Errorf("runner: set the partitions of group %q: %w", group, ErrUnknownJob)
	case errors.Is(err, ErrGroupChanging):
		return before, fmt.Errorf("runner: set the partitions of group %q: %w", group, err)
	case err != nil:
		return 0, controlErr("set the partitions of", schema, group, db, err)
	}
	return before, nil
}

// finishChange switches group's count to the next one if every current
// partition has reached the cut (see SetPartitions), in one transaction:
// it revokes the current partitions' leases, starts every partition of the
// next count at the cut, and announces the change so that every balancer
// applies it at once. It reports whether it switched.
func (r *Runner) finishChange(ctx context.Context, group string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, r.balanceTimeout())
	defer cancel()
	switched := false
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		var (
			count, next int
			cut         int64
			by          string
		)
		if err := tx.QueryRow(ctx, r.q.lockGroup, group).Scan(&count, &next, &cut, &by); err != nil || next == 0 {
			return err
		}
		var below int
		if err := tx.QueryRow(ctx, r.q.drained, group, count, cut).Scan(&below); err != nil || below > 0 {
			return err
		}
		for p := range count {
			_, _, err := lock.RevokeTx(ctx, tx, r.lcfg.Schema, groupLeasePrefix+group+"/"+fmt.Sprint(p))
			if err != nil && !errors.Is(err, lock.ErrNoLease) {
				return err
			}
		}
		if _, err := tx.Exec(ctx, r.q.createOffsets, group, next); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, r.q.switchCount, group, next, cut); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, r.q.groupAnnounce, group, 0, groupWakePrefix, membersName); err != nil {
			return err
		}
		switched = true
		r.log.Info("pgfence runner: a consumer group's partition count changed", "group", group, "from", count, "to", next,
			"cut", cut, "by", by)
		return nil
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	return switched, err
}

// GroupInfo is a consumer group as the schema records it, with its change
// of partition count under way if any (SetPartitions).
type GroupInfo struct {
	// Group is its name, Partitions its count, registered (or last
	// changed) by RegisteredBy at RegisteredAt.
	Group        string    `json:"group"`
	Partitions   int       `json:"partitions"`
	RegisteredAt time.Time `json:"registered_at"`
	RegisteredBy string    `json:"registered_by"`
	// Next is the count being changed to (0: no change under way), at the
	// cut Cut, asked by ChangeBy at ChangeAt; Drained counts the current
	// partitions that have reached the cut (the change ends when all have).
	Next     int        `json:"next"`
	Cut      int64      `json:"cut,string"`
	ChangeAt *time.Time `json:"change_at"`
	ChangeBy string     `json:"change_by"`
	Drained  int        `json:"drained"`
	// Now is the database's clock when read.
	Now time.Time `json:"now"`
}

// Groups lists the consumer groups of schema ("" means "pgfence"), or
// group alone when it is not "", with their counts and changes under way.
func Groups(ctx context.Context, db fence.DB, schema, group string) ([]GroupInfo, error) {
	if err := groupRead(ctx, db, "runner: Groups", schema, group); err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, sqlFor(schema).groups, group)
	if err != nil {
		return nil, fmt.Errorf("runner: read the consumer groups: %w", hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	infos, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (GroupInfo, error) {
		var g GroupInfo
		err := row.Scan(&g.Group, &g.Partitions, &g.RegisteredAt, &g.RegisteredBy, &g.Next, &g.Cut, &g.ChangeAt, &g.ChangeBy,
			&g.Drained, &g.Now)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("runner: read the consumer groups: %w", hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	return infos, nil
}
