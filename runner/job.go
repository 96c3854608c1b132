package runner

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/retry"
)

// Job is work that must run on exactly one machine per schedule slot (or,
// for a sharded job, on exactly one machine per shard and slot).
type Job struct {
	// Name identifies the job across replicas: every replica registers the
	// same jobs under the same names. 1-200 bytes of UTF-8. Required.
	Name string

	// Schedule says when the job runs, in one of these forms:
	//   "@every 10m"                     a fixed interval (at least MinEvery, 100ms); slots are multiples of it since the Unix epoch
	//                                    (1970-01-01 00:00 UTC), so every replica computes the same slots
	//   "0 2 * * *"                      a standard 5-field cron expression, in UTC whatever the
	//                                    machine's local time zone
	//   "CRON_TZ=Europe/Paris 0 2 * * *" cron in a named time zone (TZ= is accepted too)
	//   "@daily", "@hourly", ...         cron descriptors (UTC unless CRON_TZ is given)
	// A schedule that does not parse, or never fires (such as "0 0 30 2 *"),
	// is refused by Register. See ParseSchedule. Required.
	Schedule string

	// Run does the work for one slot. Its context is cancelled when the
	// lease is lost (the run is then fenced: its guarded writes are
	// refused), when Timeout passes, and when the runner shuts down.
	// Put every protected write through run.RunTx or run.CommitTx.
	// Required.
	Run func(ctx context.Context, run *Run) error

	// Timeout bounds one attempt. Default 0: no bound other than the lease.
	Timeout time.Duration

	// Retry is the policy for attempts that return an error.
	// Default: one attempt, no retry.
	Retry Retry

	// Missed says what to do with slots that passed while no replica ran
	// the job (downtime). Default RunLatest.
	Missed Missed
}

// Retry is a retry policy for failed attempts of a slot.
type Retry struct {
	// MaxAttempts is the most attempts a slot gets. Default 1.
	MaxAttempts int
	// Backoff is the wait before each retry, or before the first one when
	// MaxBackoff is set. Default 1s.
	Backoff time.Duration
	// MaxBackoff, when greater than Backoff, makes the waits grow: the
	// n-th retry waits a random time between half and all of
	// min(Backoff x 2^(n-1), MaxBackoff) (capped exponential backoff with
	// jitter, so replicas that failed together do not retry together).
	// Default 0: every retry waits Backoff.
	MaxBackoff time.Duration
}

// wait returns the wait before retrying after the given failed attempt
// (from 1).
func (r Retry) wait(attempt int) time.Duration {
	if r.MaxBackoff <= r.Backoff {
		return r.Backoff
	}
	return retry.Backoff{Base: r.Backoff, Max: r.MaxBackoff}.Wait(attempt - 1)
}

// Missed is a policy for the slots that passed while no replica ran the
// job (downtime): RunLatest, Skip, or CatchUp(n). It applies when a replica
// takes a job over from a ledger that has a slot of it. On a job's very
// first start there is no missed slot, whatever the policy: the job waits
// for its next slot.
type Missed int

const (
	// RunLatest runs the latest missed slot once when a replica takes the
	// job over; earlier missed slots are not run. The default.
	RunLatest Missed = 0
	// Skip runs no missed slot: a replica that takes the job over waits
	// for the next slot, unless the latest one is less than a second old.
	Skip Missed = -1
)

// MaxCatchUp is the most missed slots CatchUp runs.
const MaxCatchUp = 1000

// CatchUp returns the policy that runs up to n missed slots, the latest n,
// oldest first, each once, then follows the schedule; earlier missed slots
// are not run. n is from 1 to MaxCatchUp (Register refuses others);
// CatchUp(1) behaves as RunLatest.
func CatchUp(n int) Missed { return Missed(n) }

// slots is how many missed slots the policy runs at most.
func (p Missed) slots() int {
	switch {
	case p == Skip:
		return 0
	case p == RunLatest:
		return 1
	default:
		return int(p)
	}
}

// String names the policy: "run-latest", "skip" or "catch-up(n)".
func (p Missed) String() string {
	switch {
	case p == RunLatest:
		return "run-latest"
	case p == Skip:
		return "skip"
	case p >= 1 && p <= MaxCatchUp:
		return fmt.Sprintf("catch-up(%d)", int(p))
	default:
		return fmt.Sprintf("Missed(%d)", int(p))
	}
}

var (
	// ErrInvalidJob is matched by every *JobError: Register refused a job
	// that cannot run (no name, no Run function, negative values, a bad
	// shard count, a bad schedule).
	ErrInvalidJob = errors.New("runner: invalid job")
	// ErrInvalidSchedule is returned by ParseSchedule for a schedule that
	// does not parse, and matched by a *JobError for the Schedule field.
	// It also matches ErrInvalidJob.
	ErrInvalidSchedule = fmt.Errorf("%w: schedule", ErrInvalidJob)
	// ErrDuplicateJob is returned by Register when the name is taken.
	ErrDuplicateJob = errors.New("runner: duplicate job name")
	// ErrRunning is returned by Register after Run has started.
	ErrRunning = errors.New("runner: already running")
	// ErrFenced is returned by Run.CommitTx (and recorded) when the run's
	// slot was claimed by a newer token: the run is a zombie. It matches
	// fence.ErrFenced; a refused guard returns fence.ErrStaleToken instead.
	ErrFenced error = runFenced{}
)

// JobError says which field of a job Register refused, and why, as
// ConfigError does for Config. It matches ErrInvalidJob, and
// ErrInvalidSchedule too when the Schedule is at fault.
type JobError struct {
	// Job is the job's name (as given; it may be the invalid field).
	Job string
	// Field is the Job field at fault: Name, Run, Schedule, Timeout,
	// Retry, Missed, or "shards" for RegisterSharded's count.
	Field string
	// Reason says what is wrong.
	Reason string
	// Err is the schedule's parse error (Field "Schedule"), else nil.
	Err error
}

// Error names the job, the field and the problem.
func (e *JobError) Error() string {
	return fmt.Sprintf("runner: invalid job %q: %s: %s", e.Job, e.Field, e.Reason)
}

// Is makes errors.Is(err, ErrInvalidJob) true.
func (e *JobError) Is(target error) bool { return target == ErrInvalidJob }

// Unwrap returns the schedule's parse error, which matches
// ErrInvalidSchedule.
func (e *JobError) Unwrap() error { return e.Err }

func (j *Job) validate() (Schedule, error) {
	bad := func(field, format string, args ...any) error {
		return &JobError{Job: j.Name, Field: field, Reason: fmt.Sprintf(format, args...)}
	}
	if err := fence.ValidateName(j.Name); err != nil || len(j.Name) > 200 {
		return nil, bad("Name", "1-200 bytes of UTF-8 without NUL")
	}
	if j.Run == nil {
		return nil, bad("Run", "nil")
	}
	if j.Timeout < 0 {
		return nil, bad("Timeout", "%v is negative", j.Timeout)
	}
	if j.Retry.MaxAttempts < 0 || j.Retry.Backoff < 0 || j.Retry.MaxBackoff < 0 {
		return nil, bad("Retry", "a negative value")
	}
	if j.Missed < Skip || j.Missed > MaxCatchUp {
		return nil, bad("Missed", "%v is not RunLatest, Skip or CatchUp(1..%d)", j.Missed, MaxCatchUp)
	}
	sched, err := ParseSchedule(j.Schedule)
	if err != nil {
		return nil, &JobError{Job: j.Name, Field: "Schedule", Reason: strings.TrimPrefix(err.Error(), ErrInvalidSchedule.Error()+": "), Err: err}
	}
	if j.Retry.MaxAttempts == 0 {
		j.Retry.MaxAttempts = 1
	}
	if j.Retry.Backoff == 0 {
		j.Retry.Backoff = time.Second
	}
	return sched, nil
}

// runFenced is ErrFenced's type: it matches fence.ErrFenced too.
type runFenced struct{}

func (runFenced) Error() string { return "runner: run fenced by a newer attempt" }

func (runFenced) Is(target error) bool { return target == fence.ErrFenced }
