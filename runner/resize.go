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
// "pgfence") to n (1 to 65536), through a cut, so that every item is
// consumed once and in order per key without stopping the replicas. by
// says who changed it. It returns the count before, ErrUnknownJob for a
// group no runner registered, and ErrGroupChanging while a change to
// another count is under way (asking for the change under way again
// returns at once; asking for the count before cancels it, which is safe:
// nothing at or past the cut has been consumed yet).
//
// The offsets of a group's partitions must be positions in one sequence
// that all of them read (an outbox's transaction ids), and the consumer
// must derive an item's partition from its key and Partition.Partitions:
//
//  1. SetPartitions takes the cut: the highest committed offset of the
//     current partitions (a Commit under way finishes first). From then on
//     each current partition consumes below the cut only
//     (Partition.Until; a Commit past it is refused with
//     ErrOffsetPastUntil) and commits the cut once nothing below it can
//     still arrive.
//  2. When every current partition has committed the cut, a replica's
//     runner switches the count in one transaction: every lease of the
//     group is revoked (lock.RevokeAllTx: their leaders' commits are
//     refused from then on), every partition of the new count starts at
//     the cut with Partition.Partitions n, and the replicas take them at
//     once.
//
// The change ends only when the group's replicas run and drain to the cut:
// a replica registered with the old count or the new one may start while
// it is under way; afterwards, only one with the new count
// (ErrPartitionCount). Replicas keep leading every partition throughout;
// the switch is a handover of all of them at once. A partition that cannot
// reach the cut (an item it cannot consume) holds the change: Seek is
// refused during a change, so cancel it, set the item aside, and change
// again. Groups (`pgfence groups`) shows a change under way and how many
// partitions have reached its cut.
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
		case next != 0 && n == before: // cancelled
			if _, err := tx.Exec(ctx, q.cancelCut, group, before); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, q.groupAnnounce, group, before, groupWakePrefix, membersName)
			return err
		case next != 0:
			return fmt.Errorf("%w: to %d partitions at offset %d (asked by %s); it ends when every partition has reached the cut, "+
				"or when asked for %d partitions again", ErrGroupChanging, next, cut, changeBy, before)
		case n == before:
			return nil
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

// errNotDrained aborts a switch that found a partition below the cut once
// it held the leases (a Seek moved it meanwhile).
var errNotDrained = errors.New("runner: a partition is below the cut")

// finishChange switches group's count to the next one if every current
// partition has reached the cut (see SetPartitions), in one transaction:
// it revokes every lease of the group, starts every partition of the next
// count at the cut, and announces the change so that every balancer
// applies it at once. Its waits for lease rows and its idle time are bound
// to switchBound, since the holders' renewals wait for the rows it holds:
// a switch that would wait longer gives up, and is tried again at the next
// heartbeat. It reports whether it switched.
func (r *Runner) finishChange(ctx context.Context, group string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, r.balanceTimeout())
	defer cancel()
	var (
		count, next int
		cut         int64
		by          string
		switched    bool
	)
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, r.q.lockGroup, group).Scan(&count, &next, &cut, &by); err != nil || next == 0 {
			return err
		}
		var below int
		if err := tx.QueryRow(ctx, r.q.drained, group, count, cut).Scan(&below); err != nil || below > 0 {
			return err
		}
		bound := fmt.Sprintf("%dms", r.switchBound().Milliseconds())
		if _, err := tx.Exec(ctx, r.q.boundTx, bound); err != nil {
			return err
		}
		var names []string
		if err := tx.QueryRow(ctx, r.q.groupLeases, group, groupLeasePrefix).Scan(&names); err != nil {
			return err
		}
		if _, err := lock.RevokeAllTx(ctx, tx, r.lcfg.Schema, names); err != nil {
			return err
		}
		// Again, now that no Commit nor Seek can move an offset (they
		// need the lease rows this transaction holds).
		if err := tx.QueryRow(ctx, r.q.drained, group, count, cut).Scan(&below); err != nil {
			return err
		}
		if below > 0 {
			return errNotDrained
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
		return nil
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows), errors.Is(err, errNotDrained):
		return false, nil
	case err != nil:
		return false, err
	case !switched:
		return false, nil
	}
	r.log.Info("pgfence runner: a consumer group's partition count changed", "group", group, "from", count, "to", next,
		"cut", cut, "by", by)
	return true, nil
}

// switchBound bounds a switch's waits for lease rows and its idle time:
// half a RenewInterval, at most a second, so that the releases and
// acquisitions of the group's leases it holds up wait less than that.
func (r *Runner) switchBound() time.Duration {
	return max(min(r.lcfg.RenewInterval/2, time.Second), 10*time.Millisecond)
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
