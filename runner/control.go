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
	"github.com/pgfence/pgfence/internal/outcome"
	"github.com/pgfence/pgfence/internal/pgexec"
	"github.com/pgfence/pgfence/internal/wait"
)

// Steering jobs from outside the runner: pause, resume, run now, status.
// Each works on the schema alone, from any process (an admin endpoint, the
// CLI), whether or not it runs a Runner.

var (
	// ErrUnknownJob is returned for a job no runner has registered in the
	// schema (runners register their jobs when Run starts).
	ErrUnknownJob = errors.New("runner: unknown job (no runner has registered it in this schema)")
	// ErrNoSuchShard is returned by RunNow for a shard the job does not
	// have.
	ErrNoSuchShard = errors.New("runner: no such shard")
)

// AllShards, as RunNow's shard, asks for a run of every shard of the job.
const AllShards = -1

// RunRef names one manual run: its job, shard and slot (the time it was
// asked for).
type RunRef struct {
	Job   string    `json:"job"`
	Shard int       `json:"shard"`
	Slot  time.Time `json:"slot"`
}

// Pause stops every replica from starting the job's scheduled slots in
// schema ("" means "pgfence"): the check is part of each slot's claim, so
// it holds from each replica's next slot, with no polling. A run in
// progress finishes. Each slot that falls due while the job is paused is
// recorded as skipped, with error "paused". Manual runs (RunNow) still run.
// by says who paused it (shown by Jobs); pausing a paused job keeps the
// first pause. It returns ErrUnknownJob for a job no runner registered.
func Pause(ctx context.Context, db fence.DB, schema, job, by string) error {
	if err := ctxcheck.NotNil(ctx, "runner: Pause"); err != nil {
		return err
	}
	if err := pgexec.NotNil(db, "runner: Pause"); err != nil {
		return err
	}
	q, err := control(schema, job)
	if err != nil {
		return err
	}
	var at time.Time
	err = db.QueryRow(ctx, q.pause, job, orUnknown(by)).Scan(&at)
	return controlErr("pause", schema, job, db, err)
}

// Resume undoes Pause: from its next slot the job runs again (the slots
// skipped while paused are not run; see Missed for downtime). It returns
// ErrUnknownJob for a job no runner registered.
func Resume(ctx context.Context, db fence.DB, schema, job string) error {
	if err := ctxcheck.NotNil(ctx, "runner: Resume"); err != nil {
		return err
	}
	if err := pgexec.NotNil(db, "runner: Resume"); err != nil {
		return err
	}
	q, err := control(schema, job)
	if err != nil {
		return err
	}
	var name string
	err = db.QueryRow(ctx, q.resume, job).Scan(&name)
	return controlErr("resume", schema, job, db, err)
}

// RunNow asks for one more run of job (shard, or every shard with
// AllShards; 0 for an unsharded job) now, outside its schedule: the
// replica that leads it is woken (by a notification at commit) and runs it
// as soon as its current run, if any, ends, with its own lease token, as a
// manual slot in the ledger. Each call is one manual run per shard, run
// exactly once like any slot (retried per the job's Retry, taken over by
// the next leader if its leader dies), even when asked from a replica that
// does not lead or while leadership moves; it waits for a leader if there
// is none. by says who asked. It returns the runs it asked for; WaitRun
// waits for their outcome. It returns by ctx's deadline; if COMMIT's answer
// is lost and the server cannot be asked in time, the error is a
// *fence.UnknownOutcomeError (the runs may have been asked for: Resolve
// tells, or Runs lists them).
func RunNow(ctx context.Context, db fence.DB, schema, job string, shard int, by string) ([]RunRef, error) {
	if err := ctxcheck.NotNil(ctx, "runner: RunNow"); err != nil {
		return nil, err
	}
	if err := pgexec.NotNil(db, "runner: RunNow"); err != nil {
		return nil, err
	}
	q, err := control(schema, job)
	if err != nil {
		return nil, err
	}
	var shards int
	if err := db.QueryRow(ctx, q.jobShards, job).Scan(&shards); err != nil {
		return nil, controlErr("run", schema, job, db, err)
	}
	var want []int
	switch {
	case shard == AllShards:
		for s := range max(shards, 1) {
			want = append(want, s)
		}
	case shard < 0 || shard >= max(shards, 1):
		return nil, fmt.Errorf("%w: job %q has %s", ErrNoSuchShard, job, shardCount(shards))
	default:
		want = []int{shard}
	}
	tx, err := db.Begin(ctx) // all shards or none
	if err != nil {
		return nil, controlErr("run", schema, job, db, err)
	}
	defer pgexec.Rollback(ctx, tx)
	// The transaction's id, to learn from the server whether it committed
	// if COMMIT's answer is lost: a caller told "failed" would ask again,
	// and the job would run twice.
	var id outcome.ID
	if err := tx.QueryRow(ctx, outcome.IDQuery(ident.Schema(schema))).Scan(id.Dest()...); err != nil {
		return nil, controlErr("run", schema, job, db, err)
	}
	refs := make([]RunRef, 0, len(want))
	for _, s := range want {
		ref := RunRef{Job: job, Shard: s}
		var woke bool
		if err := tx.QueryRow(ctx, q.request, job, s, orUnknown(by), wakeName(job, shards, s)).Scan(&ref.Slot, &woke); err != nil {
			return nil, controlErr("run", schema, job, db, err)
		}
		refs = append(refs, ref)
	}
	if err := fence.UnknownOutcome(outcome.Commit(ctx, tx, db, ident.Schema(schema), id)); err != nil {
		return nil, controlErr("run", schema, job, db, err)
	}
	return refs, nil
}

// waitPoll is how often WaitRun reads the ledger.
const waitPoll = 100 * time.Millisecond

// WaitRun waits until the manual run ref has an outcome and returns its
// last attempt: succeeded, or failed or panicked with no attempt left. A
// fenced attempt is not an outcome: the job's next leader runs the slot
// again. It returns ctx's error if ctx ends first.
func WaitRun(ctx context.Context, db fence.DB, schema string, ref RunRef) (RunInfo, error) {
	if err := ctxcheck.NotNil(ctx, "runner: WaitRun"); err != nil {
		return RunInfo{}, err
	}
	if err := pgexec.NotNil(db, "runner: WaitRun"); err != nil {
		return RunInfo{}, err
	}
	q, err := control(schema, ref.Job)
	if err != nil {
		return RunInfo{}, err
	}
	for {
		var maxAttempts int
		ri, err := scanRun(db.QueryRow(ctx, q.waitRun, ref.Job, ref.Shard, string(KindManual), ref.Slot), &maxAttempts)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return RunInfo{}, fmt.Errorf("runner: no manual run of job %q, shard %d at %s", ref.Job, ref.Shard, ref.Slot.Format(time.RFC3339Nano))
		case err != nil:
			return RunInfo{}, controlErr("wait for", schema, ref.Job, db, err)
		case ri.Status == StatusSucceeded,
			(ri.Status == StatusFailed || ri.Status == StatusPanicked) && ri.Attempt >= maxAttempts:
			return ri, nil
		}
		if !wait.Sleep(ctx, waitPoll) {
			return ri, ctx.Err()
		}
	}
}

// JobInfo is what Jobs says about one job (one row per shard of a sharded
// job).
type JobInfo struct {
	Job      string `json:"job"`
	Shard    int    `json:"shard"`
	Shards   int    `json:"shards"` // 0: unsharded
	Schedule string `json:"schedule"`

	Paused   bool       `json:"paused"`
	PausedAt *time.Time `json:"paused_at"`
	PausedBy string     `json:"paused_by"`

	// Leader is the instance holding the job's (shard's) lease, "" when
	// none does; Token is the lease's newest token and LeaderSince when
	// the leader acquired it.
	Leader      string      `json:"leader"`
	Token       fence.Token `json:"token"`
	LeaderSince *time.Time  `json:"leader_since"`

	// Last is the latest attempt of the latest scheduled slot (nil if the
	// job never ran).
	Last *RunInfo `json:"last"`
	// Next is the next slot of the schedule after Now.
	Next time.Time `json:"next"`
	// Missed counts the slots that fell due after Last's slot and have no
	// attempt yet: downtime, or a slot its leader is about to claim.
	Missed int `json:"missed"`
	// Pending counts manual runs waiting for the leader.
	Pending int `json:"pending"`
	// Now is the database's time when read.
	Now time.Time `json:"now"`
}

// Jobs reads the state of every job registered in schema ("" means
// "pgfence"), or of job alone, by job and shard: who leads it, the latest
// scheduled slot's attempt, the next slot, missed slots, pending manual
// runs, the pause. One statement, reading only.
func Jobs(ctx context.Context, db fence.DB, schema, job string) ([]JobInfo, error) {
	if err := ctxcheck.NotNil(ctx, "runner: Jobs"); err != nil {
		return nil, err
	}
	if err := pgexec.NotNil(db, "runner: Jobs"); err != nil {
		return nil, err
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("runner: %w", err)
	}
	rows, err := db.Query(ctx, sqlFor(schema).jobs, job, jobLeasePrefix)
	if err != nil {
		return nil, jobsErr(schema, job, db, err)
	}
	infos, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (JobInfo, error) {
		var (
			ji       JobInfo
			tok      int64
			held     bool
			since    *time.Time
			kind     *Kind
			slot     *time.Time
			attempt  *int
			ltok     *int64
			status   *Status
			holder   *string
			by       *string
			started  *time.Time
			finished *time.Time
			msg      *string
		)
		err := r.Scan(&ji.Job, &ji.Shard, &ji.Shards, &ji.Schedule, &ji.PausedAt, &ji.PausedBy,
			&ji.Leader, &tok, &since, &held,
			&kind, &slot, &attempt, &ltok, &status, &holder, &by, &started, &finished, &msg,
			&ji.Pending, &ji.Now)
		if err != nil {
			return ji, err
		}
		ji.Paused = ji.PausedAt != nil
		ji.Token = fence.Token(tok)
		if held {
			ji.LeaderSince = since
		} else {
			ji.Leader = ""
		}
		if slot != nil {
			ji.Last = &RunInfo{Job: ji.Job, Shard: ji.Shard, Kind: *kind, Slot: *slot, Attempt: *attempt, Token: fence.Token(*ltok),
				Status: *status, Holder: *holder, RequestedBy: *by, StartedAt: *started, FinishedAt: finished, Error: *msg}
		}
		if sched, err := ParseSchedule(ji.Schedule); err == nil {
			ji.Next = sched.Next(ji.Now)
			if ji.Last != nil {
				if due := latestDue(sched, ji.Last.Slot, ji.Now); !due.IsZero() {
					ji.Missed = 1 + slotsBetween(sched, ji.Last.Slot, due)
				}
			}
		}
		return ji, nil
	})
	if err != nil {
		return nil, jobsErr(schema, job, db, err)
	}
	return infos, nil
}

// control validates a control call's schema and job and returns the
// schema's statements.
func control(schema, job string) (*queries, error) {
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("runner: %w", err)
	}
	if err := fence.ValidateName(job); err != nil {
		return nil, fmt.Errorf("runner: job: %w", err)
	}
	return sqlFor(schema), nil
}

// jobsErr explains a failed read of the jobs (of every job when job is "").
func jobsErr(schema, job string, db fence.DB, err error) error {
	if job == "" {
		return fmt.Errorf("runner: read the jobs: %w", hint.Wrap(err, ident.Schema(schema), hint.Role(db)))
	}
	return controlErr("read the jobs of", schema, job, db, err)
}

// controlErr turns "no row" into ErrUnknownJob and explains the rest.
func controlErr(what, schema, job string, db fence.DB, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("runner: %s job %q: %w", what, job, ErrUnknownJob)
	default:
		return fmt.Errorf("runner: %s job %q: %w", what, job, hint.Wrap(err, schema, hint.Role(db)))
	}
}

// wakeName is the name a manual run of job's shard is announced under.
func wakeName(job string, shards, shard int) string {
	if shards == 0 {
		return runWakePrefix + job
	}
	return runWakePrefix + job + "/" + strconv.Itoa(shard)
}

func shardCount(n int) string {
	if n == 0 {
		return "no shards (it is unsharded: use shard 0)"
	}
	return fmt.Sprintf("shards 0 to %d", n-1)
}

func orUnknown(by string) string {
	if by == "" {
		return "unknown"
	}
	return by
}
