package runner

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
)

// roleLeasePrefix names a partition's lease: roleLeasePrefix + role + "/" +
// partition. A wake-up of the partition's leader is announced as a release
// of roleWakePrefix + role + "/" + partition.
const (
	roleLeasePrefix = "pgfence/role/"
	roleWakePrefix  = "pgfence/role-wake/"
)

// Role is continuous work split into partitions: a relay draining an
// outbox, a consumer of a stream's partitions, the single writer of a key
// range. Each partition has one leader at a time among the replicas that
// register the role, and Lead runs for as long as this instance leads it.
// Partitions are spread over those replicas with sharded jobs' hashing
// (about 1/n of them move when one of n replicas joins or leaves), and each
// has a position, stored in pgfence's schema and advanced in the same
// guarded transaction as the work's effects (Partition.Commit): a stale
// leader's progress and effects are refused together, and a new leader
// resumes exactly after the last committed position.
type Role struct {
	// Name identifies the role in the schema; it shares the namespace of
	// the runner's jobs. Required.
	Name string
	// Partitions is how many partitions the role has: 1 to 65536. The
	// first runner to register the role records it in the schema; a
	// runner that gives another number does not start (Run returns a
	// *PartitionCountError), so that no partition is left without a
	// leader.
	Partitions int
	// Lead does one partition's work while this instance leads it. Its
	// context ends when the lease is lost, when a rebalance moves the
	// partition to another replica, or at shutdown; a transaction begun by
	// Partition.Commit before a move or a shutdown is finished first (the
	// handover waits for it, up to Config.ShutdownTimeout), and no new one
	// starts. Typically it loops: read the work after p.Position(), apply
	// it and the new position in p.Commit, and p.Wait when there is none.
	// A nil return means "nothing more for now": Lead is called again
	// after a wake-up or Poll. An error (or a panic) is logged and Lead is
	// called again after the shared backoff, while this instance still
	// leads. Required.
	Lead func(ctx context.Context, p *Partition) error
	// Poll is how long Partition.Wait waits when no wake-up (Wake) arrives:
	// the fallback when notifications are lost or cannot be delivered
	// (behind PgBouncer in transaction mode). Default 1s.
	Poll time.Duration
	// Head, if set, returns the newest position available for a partition
	// (what Position would be once every item there is now had been
	// processed): the partition's lag is Head - Position. The leader asks
	// it at most once per Poll, after a Commit or a Wait, and records it in
	// the schema (PartitionInfo.Head and Lag, `pgfence roles`, the status
	// page) and in the metric pgfence.runner.partition.lag. An error is
	// logged and the lag left as it was; it has max(Poll, 1s) to answer.
	// Optional.
	Head func(ctx context.Context, partition int) (int64, error)
}

// ErrPartitionCount is matched by the *PartitionCountError that Run returns
// when a role's partition count differs from the one registered in the
// schema (by the first runner that registered the role).
var ErrPartitionCount = errors.New("runner: the role's partition count differs from the registered one")

// PartitionCountError is Run's refusal to start a role with another
// partition count than the schema's. Replicas that disagree on the count
// would leave partitions without a leader (the others hand this replica
// partitions it does not know of), so the replica does not start at all:
// every replica of a role must give the registered count. It matches
// ErrPartitionCount.
type PartitionCountError struct {
	// Role is the role's name.
	Role string
	// Registered is the count in the schema; Given this runner's.
	Registered, Given int
	// RegisteredBy is the instance that registered the role, and
	// RegisteredAt when.
	RegisteredBy string
	RegisteredAt time.Time
}

// Error says which counts differ, and where the registered one comes from.
func (e *PartitionCountError) Error() string {
	return fmt.Sprintf("runner: role %q has %d partitions in the schema (registered by %s at %s); this runner gives %d: "+
		"every replica of a role must give the registered count", e.Role, e.Registered, e.RegisteredBy,
		e.RegisteredAt.UTC().Format(time.RFC3339), e.Given)
}

// Is makes errors.Is(err, ErrPartitionCount) true.
func (e *PartitionCountError) Is(target error) bool { return target == ErrPartitionCount }

// ErrPositionBackwards is returned by Partition.Commit when its function
// returns a position below the partition's current one; nothing commits.
var ErrPositionBackwards = errors.New("runner: a partition's position cannot go backwards")

// ErrPositionMoved is returned by Partition.Commit when the stored position
// is no longer the one the term knew (an earlier Commit whose outcome was
// unknown did commit): nothing of this transaction commits, and Position
// then holds the stored position, to resume from.
var ErrPositionMoved = errors.New("runner: the partition's position has moved")

func (ro Role) validate() error {
	field := func(f, reason string) error { return &JobError{Job: ro.Name, Field: f, Reason: reason} }
	switch {
	case ro.Partitions < 1 || ro.Partitions > 1<<16:
		return field("Partitions", fmt.Sprintf("must be between 1 and 65536, got %d", ro.Partitions))
	case ro.Lead == nil:
		return field("Lead", "is required")
	case ro.Poll < 0:
		return field("Poll", fmt.Sprintf("must not be negative, got %v", ro.Poll))
	}
	if err := fence.ValidateName(roleLeasePrefix + ro.Name + "/" + strconv.Itoa(ro.Partitions-1)); err != nil || ro.Name == "" {
		if err == nil {
			err = errors.New("is required")
		}
		return field("Name", err.Error())
	}
	return nil
}

// RegisterRole adds a continuous partitioned role (see Role). It returns a
// *JobError naming the bad field (it matches ErrInvalidJob),
// ErrDuplicateJob for a name already registered as a job or a role, or
// ErrRunning.
func (r *Runner) RegisterRole(ro Role) error {
	if err := ro.validate(); err != nil {
		return err
	}
	if ro.Poll == 0 {
		ro.Poll = time.Second
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running {
		return ErrRunning
	}
	if r.names[ro.Name] {
		return fmt.Errorf("%w: %q", ErrDuplicateJob, ro.Name)
	}
	r.names[ro.Name] = true
	r.jobs = append(r.jobs, &job{Job: Job{Name: ro.Name}, shards: ro.Partitions, role: &ro})
	return nil
}

// Partition is one partition of a role, as its leader sees it during one
// leadership term (handed to Role.Lead).
type Partition struct {
	// Role is the role's name.
	Role string
	// Index is the partition's number, from 0.
	Index int
	// Partitions is the role's partition count.
	Partitions int
	// Token is the fencing token of the partition's lease in this term.
	// Send it to any resource outside PostgreSQL the work writes to.
	Token fence.Token

	w        *worker
	lease    *lock.Lease
	position int64
	wake     <-chan struct{}
	poll     time.Duration
	busy     chan struct{} // holds a value while a Commit's transaction runs

	headAsked   time.Time     // when Head was last asked (real clock)
	headFailing retry.Failing // Head's failures, logged once per period
	failures    int           // Lead's consecutive errors in this term (Failures)
}

// Failures is how many times in a row Lead has returned an error (or
// panicked) in this term since the last call that returned nil or the
// last Commit that moved the position: the count to act on for an item
// that fails every time (a poison item). Set it aside in a table of your
// own in the same Commit that moves the position past it, so that it is
// set aside once, fenced like the rest (README's "Poison items").
func (p *Partition) Failures() int { return p.failures }

// failed records the outcome of a Lead call or a Commit for Failures and
// the metrics: err != nil counts one more failure; nil resets the count.
func (p *Partition) failed(err error) {
	if err != nil {
		p.failures++
	} else {
		p.failures = 0
	}
	p.w.r.m.setFailures(p.Role, p.Index, p.failures)
}

// Lease returns the partition's lease in this term.
func (p *Partition) Lease() *lock.Lease { return p.lease }

// Position is the partition's last committed position: 0 before the first
// Commit ever, then the value of the newest Commit that committed (read
// from the database when the term began, and kept by Commit).
func (p *Partition) Position() int64 { return p.position }

// Commit runs fn in a transaction guarded by the partition's token and, in
// the same transaction, advances the partition's position to the value fn
// returns (at least Position(): ErrPositionBackwards otherwise). Either the
// work's effects and the new position commit together, or neither does. A
// stale leader is refused by the database (an error matching
// fence.ErrFenced) and nothing of it commits. The position is advanced only
// from the value the term knows (a compare-and-set), so work is never
// applied twice over a position: ErrPositionMoved otherwise. Its answer is
// the truth about the commit, as fence.Guard.RunTx's: nil means committed
// (Position is then the new value); fence.ErrOutcomeUnknown means it may
// have committed (Position is then read back when the server answers).
//
// fn's statements must use the context fn is given, not ctx: it outlives a
// rebalance, so that a moving partition is handed over after the
// transaction, not in the middle of it, and it ends when the lease does.
// ctx decides whether to start: once it has ended, Commit returns its error
// and runs nothing.
func (p *Partition) Commit(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx) (next int64, err error)) error {
	if err := ctxcheck.NotNil(ctx, "runner: Partition.Commit"); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case p.busy <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-p.busy }()
	if err := ctx.Err(); err != nil { // a handover may have begun while waiting
		return err
	}
	// fn runs under the lease's context with ctx's deadline; the question
	// about a lost COMMIT answer, and the read-back below, have ctx's
	// deadline alone (the lease's end does not shorten them).
	budget := context.WithoutCancel(ctx)
	tctx := p.lease.Context()
	if dl, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		tctx, cancel = context.WithDeadline(tctx, dl)
		defer cancel()
		budget, cancel = context.WithDeadline(budget, dl)
		defer cancel()
	}
	var next int64
	err := p.lease.RunTx(budget, func(tx pgx.Tx) error {
		n, err := fn(tctx, tx)
		if err != nil {
			return err
		}
		if n < p.position {
			return fmt.Errorf("%w: %d after %d (role %q, partition %d)", ErrPositionBackwards, n, p.position, p.Role, p.Index)
		}
		tag, err := tx.Exec(tctx, p.w.r.q.advance, p.Role, p.Index, n, int64(p.Token), p.w.r.lcfg.Holder, p.position)
		if err != nil {
			return err
		}
		if tag.RowsAffected() != 1 {
			return fmt.Errorf("%w: role %q, partition %d is no longer at %d", ErrPositionMoved, p.Role, p.Index, p.position)
		}
		next = n
		return nil
	})
	switch {
	case err == nil:
		moved := next != p.position
		p.position = next
		p.w.r.m.positionCommitted(p.Role)
		if moved {
			p.failed(nil)
		}
		p.reportHead(budget)
	case errors.Is(err, ErrPositionMoved) || errors.Is(err, fence.ErrOutcomeUnknown):
		// Learn the committed position, for the next call (best effort:
		// Lead's next call reads it again anyway).
		var pos int64
		rctx, cancel := context.WithTimeout(budget, wait.CleanupTimeout)
		defer cancel()
		if p.w.r.pool.QueryRow(rctx, p.w.r.q.position, p.Role, p.Index).Scan(&pos) == nil {
			p.position = pos
		}
	}
	return err
}

// Wait waits until the partition is woken (Wake, or the announcement of a
// release of its wake name), or the role's Poll has passed, or ctx ends (it
// then returns ctx's error).
func (p *Partition) Wait(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "runner: Partition.Wait"); err != nil {
		return err
	}
	t := time.NewTimer(p.poll)
	defer t.Stop()
	select {
	case <-p.wake:
	case <-t.C:
	case <-ctx.Done():
		return ctx.Err()
	}
	p.reportHead(ctx)
	return nil
}

// reportHead asks the role's Head, at most once per Poll, and records the
// head in the schema and the partition's lag in the metrics.
func (p *Partition) reportHead(ctx context.Context) {
	head := p.w.j.role.Head
	if head == nil || time.Since(p.headAsked) < p.poll {
		return
	}
	p.headAsked = time.Now()
	hctx, cancel := context.WithTimeout(ctx, max(p.poll, time.Second))
	defer cancel()
	log := p.w.log()
	n, err := head(hctx, p.Index)
	if err == nil {
		_, err = p.w.r.pool.Exec(hctx, p.w.r.q.head, p.Role, p.Index, n)
	}
	if err != nil {
		if ctx.Err() == nil { // not the term ending: a failure, or too slow
			p.headFailing.Fail(log, "pgfence runner: reading or recording a partition's head failing; its lag is not updated", err)
		}
		return
	}
	p.headFailing.Recover(log, "pgfence runner: a partition's head is read again")
	p.w.r.m.setLag(p.Role, p.Index, max(n-p.position, 0))
}

// Wake wakes the leader of role's partition in schema ("" means
// "pgfence"), wherever it runs, so that its Wait returns at once: call it
// in the transaction that adds the partition's work (the notification is
// sent when that transaction commits). Leaders that cannot receive it
// (behind PgBouncer in transaction mode) find the work at their next Poll.
func Wake(ctx context.Context, db fence.DB, schema, role string, partition int) error {
	if err := ctxcheck.NotNil(ctx, "runner: Wake"); err != nil {
		return err
	}
	if err := pgexec.NotNil(db, "runner: Wake"); err != nil {
		return err
	}
	q, err := control(schema, role)
	if err != nil {
		return err
	}
	if partition < 0 {
		return fmt.Errorf("%w: partition %d", ErrNoSuchShard, partition)
	}
	if _, err := db.Exec(ctx, q.announce, roleWakeName(role, partition)); err != nil {
		return fmt.Errorf("runner: wake role %q partition %d: %w", role, partition, hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	return nil
}

func roleWakeName(role string, partition int) string {
	return roleWakePrefix + role + "/" + strconv.Itoa(partition)
}

// roleLoop leads the worker's partition while the balancer keeps it here
// (ctx): it campaigns with lock.Election, and when ctx ends it first ends
// Lead's context, lets a Commit in flight finish (up to ShutdownTimeout),
// and only then ends the election, which releases the lease.
func (w *worker) roleLoop(ctx context.Context) {
	electCtx, endElect := context.WithCancel(context.WithoutCancel(ctx))
	defer endElect()
	type current struct {
		cancel context.CancelFunc
		busy   chan struct{}
		lease  *lock.Lease
	}
	terms := make(chan current, 1) // the running term, if any
	e := w.election(func(lctx context.Context, l *lock.Lease) error {
		leadCtx, cancelCause := context.WithCancelCause(lctx)
		defer cancelCause(nil)
		// Why the balancer ended ctx: a shutdown (the group's cause), or
		// the partition moved away (a plain cancel).
		cancel := func() {
			if cause := context.Cause(ctx); errors.Is(cause, context.Canceled) {
				cancelCause(errMoved) // the balancer's plain cancel
			} else {
				cancelCause(cause) // a shutdown, or the runner's permanent error
			}
		}
		p, err := w.newPartition(lctx, l)
		// A transient failure is retried within the term, with a backoff:
		// ending the term would release the lease and campaign again at
		// once, drawing a token each time.
		again := retry.Backoff{Base: w.r.lcfg.PollInterval, Max: 10 * w.r.lcfg.PollInterval}
		for n := 0; err != nil && retry.Transient(err) && lctx.Err() == nil; n++ {
			if !wait.Sleep(lctx, again.Wait(n)) {
				return nil
			}
			p, err = w.newPartition(lctx, l)
		}
		if err != nil {
			if lctx.Err() != nil {
				return nil
			}
			return err
		}
		terms <- current{cancel, p.busy, l}
		defer func() { <-terms }()
		if ctx.Err() != nil {
			return nil // moved away meanwhile
		}
		return w.leadRole(leadCtx, p)
	})
	done := make(chan error, 1)
	go func() { done <- e.Run(electCtx) }() // waited for below, on every path
	select {
	case err := <-done:
		w.electionEnded(err)
		return
	case <-ctx.Done():
	}
	// Hand over: no new transaction, the one in flight finishes.
	select {
	case t := <-terms:
		t.cancel()
		timer := time.NewTimer(w.r.cfg.ShutdownTimeout)
		select {
		case t.busy <- struct{}{}:
			<-t.busy
		case <-timer.C:
			// Releasing ends the lease's context, on which the transaction
			// runs: it is cancelled, and the election (which waits for
			// Lead) can end. A takeover still waits for the transaction's
			// end at the server.
			w.log().Warn("pgfence runner: a partition's transaction did not finish within ShutdownTimeout; releasing its lease anyway")
			rctx, rcancel := wait.Detached(context.Background())
			if err := t.lease.Release(rctx); err != nil {
				w.log().Warn("pgfence runner: releasing the partition's lease failed; it expires within its TTL", "err", err)
			}
			rcancel()
		}
		timer.Stop()
		terms <- t
	default:
	}
	endElect()
	w.electionEnded(<-done)
}

// newPartition starts a term: the partition's position (its row created
// if it is new) and its wake-up subscription.
func (w *worker) newPartition(ctx context.Context, l *lock.Lease) (*Partition, error) {
	ro := w.j.role
	p := &Partition{Role: ro.Name, Index: w.shard, Partitions: ro.Partitions, Token: l.Token(),
		w: w, lease: l, poll: ro.Poll, busy: make(chan struct{}, 1)}
	if err := w.r.pool.QueryRow(ctx, w.r.q.position, ro.Name, w.shard).Scan(&p.position); err != nil {
		return nil, fmt.Errorf("runner: read the position of role %q, partition %d: %w", ro.Name, w.shard, err)
	}
	return p, nil
}

// leadRole calls the role's Lead until ctx ends: again after a nil return
// once woken or after Poll, again after the backoff after an error. The
// position is read back before each call but the first, so that a Commit
// whose outcome was unknown is not mistaken.
func (w *worker) leadRole(ctx context.Context, p *Partition) error {
	wake, stopWatch := w.r.lc.Watch(roleWakeName(p.Role, p.Index))
	defer stopWatch()
	p.wake = wake
	again := retry.Backoff{Base: w.r.lcfg.PollInterval, Max: 10 * w.r.lcfg.PollInterval}
	var failing retry.Failing
	log := w.log()
	for first := true; ctx.Err() == nil; first = false {
		if !first {
			if err := w.r.pool.QueryRow(ctx, w.r.q.position, p.Role, p.Index).Scan(&p.position); err != nil {
				if ctx.Err() != nil {
					break
				}
				failing.Fail(log, "pgfence runner: reading a partition's position failing; retrying", err)
				wait.Sleep(ctx, again.Wait(failing.Count()-1))
				continue
			}
		}
		err := w.callRole(ctx, p)
		switch {
		case ctx.Err() != nil:
		case err != nil:
			p.failed(err)
			failing.Fail(log, "pgfence runner: a role's Lead failing; calling it again after a backoff", err,
				"consecutive_failures", p.failures)
			wait.Sleep(ctx, again.Wait(failing.Count()-1))
		default:
			p.failed(nil)
			failing.Recover(log, "pgfence runner: a role's Lead recovered")
			_ = p.Wait(ctx)
		}
	}
	return context.Cause(ctx)
}

// callRole calls Lead, turning a panic into an error.
func (w *worker) callRole(ctx context.Context, p *Partition) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &panicError{value: v}
		}
	}()
	return w.j.role.Lead(ctx, p)
}

// PartitionInfo is a role's partition as the schema records it, for
// operators (`pgfence roles`, the status page).
type PartitionInfo struct {
	// Role and Partition name it.
	Role      string `json:"role"`
	Partition int    `json:"partition"`
	// Position is its last committed position.
	Position int64 `json:"position,string"`
	// Token is the lease token of the position's last commit (0: never
	// committed), and Committer the instance that made it.
	Token     fence.Token `json:"token"`
	Committer string      `json:"committer"`
	// AdvancedAt is when the position last moved (database clock; zero if
	// never): a Commit that returns the same position leaves it. A
	// consumer stuck on an item shows here as a time that grows.
	AdvancedAt time.Time `json:"advanced_at"`
	// CommittedAt is when the last Commit committed, whether the position
	// moved or not (zero if never), and Commits how many have.
	CommittedAt time.Time `json:"committed_at"`
	Commits     int64     `json:"commits"`
	// Head is the newest position available as the role's Head last
	// reported it, at HeadAt (zero: never reported), and Lag is Head -
	// Position (0 without a head, or when the position has passed it).
	Head   int64     `json:"head,string"`
	HeadAt time.Time `json:"head_at"`
	Lag    int64     `json:"lag,string"`
	// Leader is the instance holding the partition's lease now, "" if none
	// (Leading false), with LeaderToken its token.
	Leader      string      `json:"leader"`
	LeaderToken fence.Token `json:"leader_token"`
	Leading     bool        `json:"leading"`
	// Now is the database's clock when read.
	Now time.Time `json:"now"`
}

// Partitions lists the partitions of role (every role's when role is "")
// in schema ("" means "pgfence") that have ever had a leader, by role and
// partition: position, when it last advanced, and who leads each now.
func Partitions(ctx context.Context, db fence.DB, schema, role string) ([]PartitionInfo, error) {
	if err := ctxcheck.NotNil(ctx, "runner: Partitions"); err != nil {
		return nil, err
	}
	if err := pgexec.NotNil(db, "runner: Partitions"); err != nil {
		return nil, err
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("runner: %w", err)
	}
	if role != "" {
		if err := fence.ValidateName(role); err != nil {
			return nil, fmt.Errorf("runner: role: %w", err)
		}
	}
	rows, err := db.Query(ctx, sqlFor(schema).partitions, roleLeasePrefix, role)
	if err != nil {
		return nil, fmt.Errorf("runner: read the partitions: %w", hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	infos, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (PartitionInfo, error) {
		var (
			p                               PartitionInfo
			tok, ltok                       int64
			advancedAt, committedAt, headAt *time.Time
			head                            *int64
		)
		err := row.Scan(&p.Role, &p.Partition, &p.Position, &tok, &p.Committer, &advancedAt, &committedAt, &p.Commits,
			&head, &headAt, &p.Leader, &ltok, &p.Leading, &p.Now)
		if head != nil && headAt != nil {
			// The head is read at most once per Poll while the position
			// moves on: a position past the last head read means no lag.
			p.Head, p.HeadAt, p.Lag = *head, *headAt, max(*head-p.Position, 0)
		}
		p.Token, p.LeaderToken = fence.Token(tok), fence.Token(ltok)
		if advancedAt != nil {
			p.AdvancedAt = *advancedAt
		}
		if committedAt != nil {
			p.CommittedAt = *committedAt
		}
		if !p.Leading {
			p.Leader, p.LeaderToken = "", 0
		}
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("runner: read the partitions: %w", hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	return infos, nil
}
