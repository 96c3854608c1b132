package runner

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/retry"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
)

// groupLeasePrefix names a partition's lease: groupLeasePrefix + group +
// "/" + partition. A wake-up of the partition's leader is announced as a
// release of groupWakePrefix + group + "/" + partition.
const (
	groupLeasePrefix = "pgfence/group/"
	groupWakePrefix  = "pgfence/group-wake/"
)

// Consumer is continuous work split into partitions, consumed by a group
// of replicas as a Kafka consumer group consumes a topic: a relay draining
// an outbox, a consumer of a stream's partitions, the single writer of a
// key range. Every replica registers the same Consumer; each partition has
// one leader at a time among them, and Consume runs for as long as this
// instance leads it. Partitions are spread over the group with sharded
// jobs' hashing (about 1/n of them move when one of n replicas joins or
// leaves), and each has a committed offset, stored in pgfence's schema and
// advanced in the same guarded transaction as the work's effects
// (Partition.Commit): a stale leader's progress and effects are refused
// together, and a new leader resumes at the committed offset.
//
// An offset is Kafka's committed offset: the offset of the next item to
// read. Items below it are done; a partition starts at 0.
type Consumer struct {
	// Group names the consumer group in the schema; it shares the
	// namespace of the runner's jobs. Required.
	Group string
	// Partitions is how many partitions the group consumes: 1 to 65536.
	// The first runner to register the group records it in the schema; a
	// runner that gives another number does not start (Run returns a
	// *PartitionCountError), so that no partition is left without a
	// leader. SetPartitions changes it.
	Partitions int
	// Consume does one partition's work while this instance leads it. Its
	// context ends when the lease is lost, when a rebalance moves the partition to another replica, or at shutdown; a
	// transaction begun by Partition.Commit before a move or a shutdown is
	// finished first (the handover waits for it, up to
	// Config.ShutdownTimeout), and no new one starts. Typically it loops:
	// read the items at p.Offset() and after, apply them and commit the
	// offset after the last one in p.Commit, and p.Wait when there are
	// none. A nil return means "nothing more for now": Consume is called
	// again after a wake-up or Poll. An error (or a panic) is logged and
	// Consume is called again after the shared backoff, while this
	// instance still leads (Partition.Failures counts them). Required.
	Consume func(ctx context.Context, p *Partition) error
	// Poll is how long Partition.Wait waits when no wake-up (Wake) arrives:
	// the fallback when notifications are lost or cannot be delivered
	// (behind PgBouncer in transaction mode). Default 1s.
	Poll time.Duration
	// End, if set, returns a partition's end offset: the offset the next
	// item to arrive will have (Kafka's log-end offset; for an outbox, its
	// newest id + 1). The partition's lag is End - Offset: the items not
	// consumed yet. The leader asks it at most once per Poll, after a
	// Commit or a Wait, and records it in the schema (PartitionInfo.End
	// and Lag, `pgfence groups`, the status page) and in the metric
	// pgfence.runner.partition.lag. An error is logged and the lag left as
	// it was; it has max(Poll, 1s) to answer. Optional.
	End func(ctx context.Context, partition int) (int64, error)
}

// ErrPartitionCount is matched by the *PartitionCountError that Run returns
// when a group's partition count differs from the one registered in the
// schema (by the first runner that registered the group).
var ErrPartitionCount = errors.New("runner: the group's partition count differs from the registered one")

// PartitionCountError is Run's refusal to start a consumer group with
// another partition count than the schema's. Replicas that disagree on the
// count would leave partitions without a leader (the others hand this
// replica partitions it does not know of), so the replica does not start
// at all: every replica of a group must give the registered count
// (SetPartitions changes it). It matches ErrPartitionCount.
type PartitionCountError struct {
	// Group is the consumer group's name.
	Group string
	// Registered is the count in the schema; Given this runner's.
	Registered, Given int
	// RegisteredBy is the instance that registered the count, and
	// RegisteredAt when.
	RegisteredBy string
	RegisteredAt time.Time
}

// Error says which counts differ, and where the registered one comes from.
func (e *PartitionCountError) Error() string {
	return fmt.Sprintf("runner: group %q has %d partitions in the schema (registered by %s at %s); this runner gives %d: "+
		"every replica of a group must give the registered count (runner.SetPartitions changes it)", e.Group, e.Registered, e.RegisteredBy,
		e.RegisteredAt.UTC().Format(time.RFC3339), e.Given)
}

// Is makes errors.Is(err, ErrPartitionCount) true.
func (e *PartitionCountError) Is(target error) bool { return target == ErrPartitionCount }

// ErrOffsetBackwards is returned by Partition.Commit when its function
// returns an offset below the partition's committed one; nothing commits.
var ErrOffsetBackwards = errors.New("runner: a partition's offset cannot go backwards")

// ErrInvalidOffset is returned by Seek for a negative offset.
var ErrInvalidOffset = errors.New("runner: invalid offset")

// ErrOffsetPastUntil is returned by Partition.Commit when its function
// returns an offset past Partition.Until while the group's partition count
// changes: nothing commits, and Until then holds the cut (see
// SetPartitions).
var ErrOffsetPastUntil = errors.New("runner: a partition's offset cannot pass the cut of a change of the partition count")

// ErrOffsetMoved is returned by Partition.Commit when the stored offset is
// no longer the one the term knew (an earlier Commit whose outcome was
// unknown did commit): nothing of this transaction commits, and Offset then
// holds the stored offset, to resume from.
var ErrOffsetMoved = errors.New("runner: the partition's offset has moved")

func (c Consumer) validate() error {
	field := func(f, reason string) error { return &JobError{Job: c.Group, Field: f, Reason: reason} }
	switch {
	case c.Partitions < 1 || c.Partitions > 1<<16:
		return field("Partitions", fmt.Sprintf("must be between 1 and 65536, got %d", c.Partitions))
	case c.Consume == nil:
		return field("Consume", "is required")
	case c.Poll < 0:
		return field("Poll", fmt.Sprintf("must not be negative, got %v", c.Poll))
	}
	if err := fence.ValidateName(groupLeasePrefix + c.Group + "/" + strconv.Itoa(c.Partitions-1)); err != nil || c.Group == "" {
		if err == nil {
			err = errors.New("is required")
		}
		return field("Group", err.Error())
	}
	return nil
}

// RegisterConsumer adds a consumer group's member (see Consumer). It
// returns a *JobError naming the bad field (it matches ErrInvalidJob),
// ErrDuplicateJob for a name already registered as a job or a group, or
// ErrRunning.
func (r *Runner) RegisterConsumer(c Consumer) error {
	if err := c.validate(); err != nil {
		return err
	}
	if c.Poll == 0 {
		c.Poll = time.Second
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running {
		return ErrRunning
	}
	if r.names[c.Group] {
		return fmt.Errorf("%w: %q", ErrDuplicateJob, c.Group)
	}
	r.names[c.Group] = true
	j := &job{Job: Job{Name: c.Group}, shards: c.Partitions, group: &c}
	j.parts.Store(int64(c.Partitions))
	r.jobs = append(r.jobs, j)
	return nil
}

// Partition is one partition of a consumer group, as its leader sees it
// during one leadership term (handed to Consumer.Consume).
type Partition struct {
	// Group is the consumer group's name.
	Group string
	// Index is the partition's number, from 0.
	Index int
	// Partitions is the group's partition count in this term, as the
	// schema records it (it changes with SetPartitions; a consumer that
	// derives an item's partition from its key uses this one).
	Partitions int
	// Token is the fencing token of the partition's lease in this term.
	// Send it to any resource outside PostgreSQL the work writes to.
	Token fence.Token

	w      *worker
	lease  *lock.Lease
	offset int64
	until  int64 // math.MaxInt64 but during a change of the count
	wake   <-chan struct{}
	poll   time.Duration
	busy   chan struct{} // holds a value while a Commit's transaction runs

	endAsked   time.Time     // when End was last asked (real clock)
	endFailing retry.Failing // End's failures, logged once per period
	failures   int           // Consume's consecutive errors in this term (Failures)
}

// Failures is how many times in a row Consume has returned an error (or
// panicked) in this term since the last call that returned nil or the last
// Commit that moved the offset: the count to act on for an item that fails
// every time (a poison item). Set it aside in a table of your own in the
// same Commit that moves the offset past it, so that it is set aside once,
// fenced like the rest (README's "Poison items").
func (p *Partition) Failures() int { return p.failures }

// failed records the outcome of a Consume call or a Commit for Failures
// and the metrics: err != nil counts one more failure; nil resets the
// count.
func (p *Partition) failed(err error) {
	if err != nil {
		p.failures++
	} else {
		p.failures = 0
	}
	p.w.r.m.setFailures(p.Group, p.Index, p.failures)
}

// Lease returns the partition's lease in this term.
func (p *Partition) Lease() *lock.Lease { return p.lease }

// Offset is the partition's committed offset: the offset of the next item
// to read (items below it are done). It is 0 before the first Commit ever,
// then the value of the newest Commit that committed (read from the
// database when the term began, and kept by Commit).
func (p *Partition) Offset() int64 { return p.offset }

// Until is where this partition's consumption stops: math.MaxInt64, but
// while the group's partition count changes (SetPartitions with replicas
// running) the change's cut. Items at or past it are the next count's
// partitions': read only below it, and commit Until once nothing below it
// can still arrive (for an outbox read by transaction id, once the
// snapshot's xmin has passed it); the change ends when every partition
// has. A Commit past it is refused with ErrOffsetPastUntil. Read when the
// term began and before each call of Consume.
func (p *Partition) Until() int64 { return p.until }

// read reads the partition's committed offset and cut, and at the term's
// start the group's partition count, from the schema (its row created if
// it is new).
func (p *Partition) read(ctx context.Context) error {
	var (
		until *int64
		count int
	)
	if err := p.w.r.pool.QueryRow(ctx, p.w.r.q.offset, p.Group, p.Index).Scan(&p.offset, &until, &count); err != nil {
		return fmt.Errorf("runner: read the offset of group %q, partition %d: %w", p.Group, p.Index, err)
	}
	if p.Partitions == 0 { // a term's count is the one at its start (a switch revokes every term)
		p.Partitions = count
	}
	p.until = math.MaxInt64
	if until != nil {
		p.until = *until
	}
	return nil
}

// Commit runs fn in a transaction guarded by the partition's token and, in
// the same transaction, commits the offset fn returns as the partition's:
// the offset of the next item to read, so one past the last item fn
// applied (at least Offset(): ErrOffsetBackwards otherwise). Either the
// work's effects and the new offset commit together, or neither does. A
// stale leader is refused by the database (an error matching
// fence.ErrFenced) and nothing of it commits. The offset is advanced only
// from the value the term knows (a compare-and-set), so work is never
// applied twice: ErrOffsetMoved otherwise. Its answer is the truth about
// the commit, as fence.Guard.RunTx's: nil means committed (Offset is then
// the new value); fence.ErrOutcomeUnknown means it may have committed
// (Offset is then read back when the server answers).
//
// fn's context carries ctx's values (a trace span, a request's logger) and
// its deadline, but not its cancellation: it ends when the lease does, and
// outlives a rebalance, so that a moving partition is handed over after
// the transaction, not in the middle of it. fn's statements must use it.
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
	if dl, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		budget, cancel = context.WithDeadline(budget, dl)
		defer cancel()
	}
	tctx, cancel := leaseBound(ctx, p.lease.Context())
	defer cancel()
	var next int64
	err := p.lease.RunTx(budget, func(tx pgx.Tx) error {
		n, err := fn(tctx, tx)
		if err != nil {
			return err
		}
		if n < p.offset {
			return fmt.Errorf("%w: %d after %d (group %q, partition %d)", ErrOffsetBackwards, n, p.offset, p.Group, p.Index)
		}
		tag, err := tx.Exec(tctx, p.w.r.q.advance, p.Group, p.Index, n, int64(p.Token), p.w.r.lcfg.Holder, p.offset)
		if err != nil {
			return err
		}
		if tag.RowsAffected() != 1 {
			var (
				now   int64
				until *int64
			)
			if err := tx.QueryRow(tctx, p.w.r.q.afterAdvance, p.Group, p.Index).Scan(&now, &until); err != nil {
				return err
			}
			if until != nil && n > *until && now == p.offset {
				p.until = *until
				return fmt.Errorf("%w: %d past %d (group %q, partition %d)", ErrOffsetPastUntil, n, *until, p.Group, p.Index)
			}
			return fmt.Errorf("%w: group %q, partition %d is no longer at %d", ErrOffsetMoved, p.Group, p.Index, p.offset)
		}
		next = n
		return nil
	})
	switch {
	case err == nil:
		moved := next != p.offset
		p.offset = next
		p.w.r.m.offsetCommitted(p.Group)
		if moved {
			p.failed(nil)
		}
		p.reportEnd(budget)
		if next == p.until {
			// This partition is through the cut: the change of count
			// may end now (the balancer looks again anyway).
			p.w.r.nudgeBalancer()
		}
	case errors.Is(err, ErrOffsetMoved) || errors.Is(err, fence.ErrOutcomeUnknown):
		// Learn the committed offset, for the next call (best effort:
		// Consume's next call reads it again anyway).
		rctx, cancel := context.WithTimeout(budget, wait.CleanupTimeout)
		defer cancel()
		_ = p.read(rctx)
	}
	return err
}

// leaseBound returns a context with ctx's values and deadline that ends
// when lease does (with its cause), not when ctx is cancelled.
func leaseBound(ctx, lease context.Context) (context.Context, context.CancelFunc) {
	c, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	stop := context.AfterFunc(lease, func() { cancel(context.Cause(lease)) })
	end := func() {}
	if dl, ok := ctx.Deadline(); ok {
		c, end = context.WithDeadline(c, dl)
	}
	return c, func() {
		stop()
		end()
		cancel(context.Canceled)
	}
}

// Wait waits until the partition is woken (Wake, or the announcement of a
// release of its wake name), or the group's Poll has passed, or ctx ends (it
// then returns ctx's error).
func (p *Partition) Wait(ctx context.Context) error {
	if err := ctxcheck.NotNil(ctx, "runner: Partition.Wait"); err != nil {
		return err
	}
	t := time.NewTimer(p.poll)
	defer t.Stop()
	select {
	case <-p.wake:
		// A wake-up may announce a change of the partition count: learn
		// its cut (Until) now, not from a refused Commit.
		_ = p.read(ctx)
	case <-t.C:
	case <-ctx.Done():
		return ctx.Err()
	}
	p.reportEnd(ctx)
	return nil
}

// reportEnd asks the group's End, at most once per Poll, and records the
// end offset in the schema and the partition's lag in the metrics.
func (p *Partition) reportEnd(ctx context.Context) {
	end := p.w.j.group.End
	if end == nil || time.Since(p.endAsked) < p.poll {
		return
	}
	p.endAsked = time.Now()
	hctx, cancel := context.WithTimeout(ctx, max(p.poll, time.Second))
	defer cancel()
	log := p.w.log()
	var (
		n   int64
		err error
	)
	p.w.user(func() { n, err = end(hctx, p.Index) })
	if err == nil {
		_, err = p.w.r.pool.Exec(hctx, p.w.r.q.end, p.Group, p.Index, n)
	}
	if err != nil {
		if ctx.Err() == nil { // not the term ending: a failure, or too slow
			p.endFailing.Fail(log, "pgfence runner: reading or recording a partition's end offset failing; its lag is not updated", err)
		}
		return
	}
	p.endFailing.Recover(log, "pgfence runner: a partition's end offset is read again")
	p.w.r.m.setLag(p.Group, p.Index, max(n-p.offset, 0))
}

// Wake wakes the leader of group's partition in schema ("" means
// "pgfence"), wherever it runs, so that its Wait returns at once: call it
// in the transaction that adds the partition's work (the notification is
// sent when that transaction commits). Leaders that cannot receive it
// (behind PgBouncer in transaction mode) find the work at their next Poll.
func Wake(ctx context.Context, db fence.DB, schema, group string, partition int) error {
	if err := ctxcheck.NotNil(ctx, "runner: Wake"); err != nil {
		return err
	}
	if err := pgexec.NotNil(db, "runner: Wake"); err != nil {
		return err
	}
	q, err := control(schema, group)
	if err != nil {
		return err
	}
	if partition < 0 {
		return fmt.Errorf("%w: partition %d", ErrNoSuchShard, partition)
	}
	if _, err := db.Exec(ctx, q.announce, groupWakeName(group, partition)); err != nil {
		return fmt.Errorf("runner: wake group %q partition %d: %w", group, partition, hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	return nil
}

func groupWakeName(group string, partition int) string {
	return groupWakePrefix + group + "/" + strconv.Itoa(partition)
}

// groupLoop leads the worker's partition while the balancer keeps it here
// (ctx): it campaigns with lock.Election, and when ctx ends it first ends
// Consume's context, lets a Commit in flight finish (up to ShutdownTimeout),
// and only then ends the election, which releases the lease.
func (w *worker) groupLoop(ctx context.Context) {
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
		if p.Index >= p.Partitions {
			// The group's count went down past this partition: the
			// balancer stops this worker at its next look.
			<-leadCtx.Done()
			return context.Cause(leadCtx)
		}
		return w.consumeLoop(leadCtx, p)
	})
	var electErr error
	elect := bg.Run(electCtx, func(ctx context.Context) { electErr = e.Run(ctx) }) // waited for below, on every path
	select {
	case <-elect.Done():
		w.electionEnded(electErr)
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
			// Consume) can end. A takeover still waits for the transaction's
			// end at the server.
			w.log().Warn("pgfence runner: a partition's transaction did not finish within ShutdownTimeout; releasing its lease anyway")
			rctx, rcancel := wait.Detached(context.Background())
			w.endTerm(rctx, t.lease, termCause(context.Cause(ctx)))
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
	<-elect.Done()
	w.electionEnded(electErr)
}

// newPartition starts a term: the partition's offset (its row created
// if it is new) and its wake-up subscription.
func (w *worker) newPartition(ctx context.Context, l *lock.Lease) (*Partition, error) {
	c := w.j.group
	p := &Partition{Group: c.Group, Index: w.shard, Token: l.Token(),
		w: w, lease: l, poll: c.Poll, busy: make(chan struct{}, 1)}
	if err := p.read(ctx); err != nil {
		return nil, err
	}
	return p, nil
}

// consumeLoop calls the group's Consume until ctx ends: again after a nil return
// once woken or after Poll, again after the backoff after an error. The
// offset is read back before each call but the first, so that a Commit
// whose outcome was unknown is not mistaken.
func (w *worker) consumeLoop(ctx context.Context, p *Partition) error {
	wake, stopWatch := w.r.lc.Watch(groupWakeName(p.Group, p.Index))
	defer stopWatch()
	p.wake = wake
	again := retry.Backoff{Base: w.r.lcfg.PollInterval, Max: 10 * w.r.lcfg.PollInterval}
	var failing retry.Failing
	log := w.log()
	for first := true; ctx.Err() == nil; first = false {
		if !first {
			if err := p.read(ctx); err != nil {
				if ctx.Err() != nil {
					break
				}
				failing.Fail(log, "pgfence runner: reading a partition's offset failing; retrying", err)
				wait.Sleep(ctx, again.Wait(failing.Count()-1))
				continue
			}
		}
		err := w.callConsume(ctx, p)
		switch {
		case ctx.Err() != nil:
		case errors.Is(err, ErrOffsetPastUntil):
			// Not a failure: the cut of a change of the count arrived
			// during the call; the next one reads it (Until).
		case err != nil:
			p.failed(err)
			failing.Fail(log, "pgfence runner: a partition's Consume failing; calling it again after a backoff", err,
				"consecutive_failures", p.failures)
			wait.Sleep(ctx, again.Wait(failing.Count()-1))
		default:
			p.failed(nil)
			failing.Recover(log, "pgfence runner: a partition's Consume recovered")
			_ = p.Wait(ctx)
		}
	}
	return context.Cause(ctx)
}

// callConsume calls Consume, turning a panic into an error.
func (w *worker) callConsume(ctx context.Context, p *Partition) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &panicError{value: v}
		}
	}()
	w.user(func() { err = w.j.group.Consume(ctx, p) })
	return err
}

// Seek sets the committed offset of group's partition in schema ("" means
// "pgfence") to offset, fenced: in one transaction it revokes the
// partition's lease (lock.RevokeTx: a token greater than the leader's,
// held by nobody) and writes the offset with that token. The leader's
// Commits after it are refused (fence.ErrFenced) and its lease is lost
// (its Consume's context ends); the next leader, with a greater token
// still, resumes at offset. A Commit of the leader's that was under way
// either committed before Seek (which waits for it) or is refused: a seek
// never races the live leader. Going back re-delivers the items between;
// going forward skips them. by says who sought (the offset's holder).
// It returns the offset before, ErrInvalidOffset for a negative offset,
// ErrGroupChanging while the group's partition count changes, and
// ErrUnknownJob for a partition that has never had a leader.
func Seek(ctx context.Context, db fence.DB, schema, group string, partition int, offset int64, by string) (before int64, err error) {
	if err := ctxcheck.NotNil(ctx, "runner: Seek"); err != nil {
		return 0, err
	}
	if err := pgexec.NotNil(db, "runner: Seek"); err != nil {
		return 0, err
	}
	q, err := control(schema, group)
	if err != nil {
		return 0, err
	}
	if partition < 0 {
		return 0, fmt.Errorf("%w: partition %d", ErrNoSuchShard, partition)
	}
	if offset < 0 {
		return 0, fmt.Errorf("%w: %d is negative", ErrInvalidOffset, offset)
	}
	name := groupLeasePrefix + group + "/" + strconv.Itoa(partition)
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var changing bool
		if err := tx.QueryRow(ctx, q.changing, group).Scan(&changing); err != nil {
			return err
		}
		if changing {
			return fmt.Errorf("%w: a seek would move a partition across the cut; cancel the change first (SetPartitions with the current count)",
				ErrGroupChanging)
		}
		tok, _, err := lock.RevokeTx(ctx, tx, schema, name)
		if err != nil {
			return err
		}
		return tx.QueryRow(ctx, q.seek, group, partition, offset, int64(tok), orUnknown(by)).Scan(&before)
	})
	switch {
	case errors.Is(err, ErrGroupChanging):
		return 0, fmt.Errorf("runner: seek group %q partition %d: %w", group, partition, err)
	case errors.Is(err, lock.ErrNoLease), errors.Is(err, pgx.ErrNoRows):
		return 0, fmt.Errorf("runner: seek group %q partition %d: %w (it has never had a leader)", group, partition, ErrUnknownJob)
	case err != nil:
		return 0, fmt.Errorf("runner: seek group %q partition %d: %w", group, partition, hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	return before, nil
}

// PartitionInfo is a consumer group's partition as the schema records it,
// for operators (`pgfence groups`, the status page).
type PartitionInfo struct {
	// Group and Partition name it.
	Group     string `json:"group"`
	Partition int    `json:"partition"`
	// Offset is its committed offset: the next item to read.
	Offset int64 `json:"offset,string"`
	// Token is the lease token of the offset's last commit (0: never
	// committed), and Committer the instance that made it.
	Token     fence.Token `json:"token"`
	Committer string      `json:"committer"`
	// AdvancedAt is when the offset last moved (database clock; zero if
	// never): a Commit that returns the same offset leaves it. A consumer
	// stuck on an item shows here as a time that grows.
	AdvancedAt time.Time `json:"advanced_at"`
	// CommittedAt is when the last Commit committed, whether the offset
	// moved or not (zero if never), and Commits how many have.
	CommittedAt time.Time `json:"committed_at"`
	Commits     int64     `json:"commits"`
	// End is the partition's end offset as the group's End last reported
	// it, at EndAt (zero: never reported), and Lag is End - Offset: the
	// items not consumed yet (0 without an end offset, or when the
	// committed offset has passed it).
	End   int64     `json:"end,string"`
	EndAt time.Time `json:"end_at"`
	Lag   int64     `json:"lag,string"`
	// Leader is the instance holding the partition's lease now, "" if none
	// (Leading false), with LeaderToken its token.
	Leader      string      `json:"leader"`
	LeaderToken fence.Token `json:"leader_token"`
	Leading     bool        `json:"leading"`
	// LeaderlessSince is when the partition's last leader's lease ended
	// (released, expired or revoked) while nobody leads it; zero while it
	// is led.
	LeaderlessSince time.Time `json:"leaderless_since"`
	// Now is the database's clock when read.
	Now time.Time `json:"now"`
}

// Partitions lists the partitions of group (every group's when group is
// "") in schema ("" means "pgfence") that have ever had a leader, by group
// and partition: committed offset, lag, when it last advanced, and who
// leads each now.
func Partitions(ctx context.Context, db fence.DB, schema, group string) ([]PartitionInfo, error) {
	if err := groupRead(ctx, db, "runner: Partitions", schema, group); err != nil {
		return nil, err
	}
	rows, err := db.Query(ctx, sqlFor(schema).partitions, groupLeasePrefix, group)
	if err != nil {
		return nil, fmt.Errorf("runner: read the partitions: %w", hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	infos, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (PartitionInfo, error) {
		var (
			p                              PartitionInfo
			tok, ltok                      int64
			advancedAt, committedAt, endAt *time.Time
			leaderless                     *time.Time
			end                            *int64
		)
		err := row.Scan(&p.Group, &p.Partition, &p.Offset, &tok, &p.Committer, &advancedAt, &committedAt, &p.Commits,
			&end, &endAt, &p.Leader, &ltok, &p.Leading, &leaderless, &p.Now)
		if leaderless != nil {
			p.LeaderlessSince = *leaderless
		}
		if end != nil && endAt != nil {
			// The end offset is read at most once per Poll while the
			// offset moves on: an offset past the last end read means no
			// lag.
			p.End, p.EndAt, p.Lag = *end, *endAt, max(*end-p.Offset, 0)
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

// groupRead checks the arguments of a read of the consumer groups (what
// names the caller): group "" means every group.
func groupRead(ctx context.Context, db fence.DB, what, schema, group string) error {
	if err := ctxcheck.NotNil(ctx, what); err != nil {
		return err
	}
	if err := pgexec.NotNil(db, what); err != nil {
		return err
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return fmt.Errorf("runner: %w", err)
	}
	if group != "" {
		if err := fence.ValidateName(group); err != nil {
			return fmt.Errorf("runner: group: %w", err)
		}
	}
	return nil
}
