package runner

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/ctxcheck"
	"github.com/pgfence/pgfence/internal/hint"
	"github.com/pgfence/pgfence/internal/ident"
	"github.com/pgfence/pgfence/internal/pgexec"
)

// InstanceInfo is what Instances says about one runner instance: its
// liveness row in pgfence_instances and the job leases it holds.
type InstanceInfo struct {
	ID          string    `json:"id"`
	StartedAt   time.Time `json:"started_at"`
	HeartbeatAt time.Time `json:"heartbeat_at"`
	// ExpiresAt is when the instance counts as gone unless it heartbeats
	// again; Live reports ExpiresAt > Now. A row that stopped heartbeating
	// is kept a while, then deleted by the live instances.
	ExpiresAt time.Time `json:"expires_at"`
	Live      bool      `json:"live"`
	// StoppedAt is when the instance stopped cleanly (its Run returned),
	// nil while it runs or if it stopped heartbeating without a word (a
	// crash, a kill, a lost network).
	StoppedAt *time.Time `json:"stopped_at"`
	// Jobs names the jobs the instance registered (it runs them when it
	// leads them), and Groups the consumer groups it is a member of.
	Jobs   []string `json:"jobs"`
	Groups []string `json:"groups"`
	// Leads lists the jobs and shards whose lease the instance holds, and
	// Partitions the consumer groups' partitions.
	Leads      []Lead          `json:"leads"`
	Partitions []PartitionLead `json:"partitions"`
	// Now is the database's time when read.
	Now time.Time `json:"now"`
}

// Lead is one job (shard) an instance leads, with its lease token.
type Lead struct {
	Job   string      `json:"job"`
	Shard int         `json:"shard"`
	Token fence.Token `json:"token"`
}

// PartitionLead is one partition of a consumer group an instance leads,
// with its lease token.
type PartitionLead struct {
	Group     string      `json:"group"`
	Partition int         `json:"partition"`
	Token     fence.Token `json:"token"`
}

// Instances reads the runner instances of schema ("" means "pgfence"), by
// id: live ones, and those that stopped heartbeating recently (Live false).
// One statement, reading only.
func Instances(ctx context.Context, db fence.DB, schema string) ([]InstanceInfo, error) {
	if err := ctxcheck.NotNil(ctx, "runner: Instances"); err != nil {
		return nil, err
	}
	if err := pgexec.NotNil(db, "runner: Instances"); err != nil {
		return nil, err
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("runner: %w", err)
	}
	rows, err := db.Query(ctx, sqlFor(schema).instances, jobLeasePrefix, groupLeasePrefix)
	if err != nil {
		return nil, fmt.Errorf("runner: read the instances: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	infos, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (InstanceInfo, error) {
		var (
			ii                   InstanceInfo
			registered           []string
			jobs, groups         []string
			shards, parts        []int
			tokens, partitionTok []int64
		)
		err := r.Scan(&ii.ID, &ii.StartedAt, &ii.HeartbeatAt, &ii.ExpiresAt, &ii.Live, &ii.StoppedAt, &registered,
			&jobs, &shards, &tokens, &groups, &parts, &partitionTok, &ii.Now)
		ii.Jobs, ii.Groups = []string{}, []string{}
		for _, name := range registered {
			if group, ok := strings.CutPrefix(name, groupLeasePrefix); ok {
				ii.Groups = append(ii.Groups, group)
			} else {
				ii.Jobs = append(ii.Jobs, name)
			}
		}
		ii.Leads, ii.Partitions = []Lead{}, []PartitionLead{}
		for i := range jobs {
			ii.Leads = append(ii.Leads, Lead{Job: jobs[i], Shard: shards[i], Token: fence.Token(tokens[i])})
		}
		for i := range groups {
			ii.Partitions = append(ii.Partitions, PartitionLead{Group: groups[i], Partition: parts[i], Token: fence.Token(partitionTok[i])})
		}
		return ii, err
	})
	if err != nil {
		return nil, fmt.Errorf("runner: read the instances: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	return infos, nil
}

// Term is one leadership term of a job's lease (a singleton job's, or a
// sharded job's shard) or of a consumer group's partition: who led it with
// which token, from when to when, why it ended, and the attempts it ran.
type Term struct {
	// Job is the job's name, or Group the consumer group's (the other is
	// ""), and Shard the job's shard (0 for a singleton job) or the
	// group's partition.
	Job   string `json:"job,omitempty"`
	Group string `json:"group,omitempty"`
	Shard int    `json:"shard"`
	// Token is the term's lease token, and Holder the instance that led.
	Token  fence.Token `json:"token"`
	Holder string      `json:"holder"`
	// Started is when the term began (database clock), and Ended when it
	// ended (zero while it goes on).
	Started time.Time `json:"started"`
	Ended   time.Time `json:"ended"`
	// EndCause says why it ended ("" while it goes on): one of the End...
	// constants; Why says it in words.
	EndCause string `json:"end_cause"`
	// FirstRun and LastRun are when the term's first and latest attempts
	// started, and Attempts counts them (a consumer group's partitions
	// have none); Until is when its last attempt ended (one that still
	// runs counts from its start). Fenced counts the attempts refused as
	// stale or taken over.
	FirstRun time.Time `json:"first_run"`
	LastRun  time.Time `json:"last_run"`
	Until    time.Time `json:"until"`
	Attempts int       `json:"attempts"`
	Fenced   int       `json:"fenced"`
	// Now is the database's clock when read.
	Now time.Time `json:"now"`
}

// The causes of a term's end (Term.EndCause), also the attribute
// pgfence.cause of pgfence.runner.leadership.changes.
const (
	// EndReleased: the term's work ended and released the lease.
	EndReleased = "released"
	// EndMoved: a rebalance gave the shard or partition to another
	// replica.
	EndMoved = "moved"
	// EndHandedOver: the job went to its preferred replica.
	EndHandedOver = "handed_over"
	// EndShutdown: its replica shut down.
	EndShutdown = "shutdown"
	// EndLeaseLost: its leader lost the lease (a renewal refused or too
	// late).
	EndLeaseLost = "lease_lost"
	// EndFailed: an error ended it.
	EndFailed = "failed"
	// EndExpired: its leader did not end it (killed, frozen past its
	// lease, cut off from the database); the next leader closed it.
	EndExpired = "expired"
	// EndRevoked: its lease was revoked: a Seek, or the switch of a
	// consumer group's partition count.
	EndRevoked = "revoked"
)

// Why says why the term ended, in words ("" while it goes on).
func (t Term) Why() string {
	if w, ok := termWhy[t.EndCause]; ok {
		return w
	}
	return t.EndCause
}

// TermFilter selects terms for Terms. The zero value selects the 20 most
// recent terms of every job.
type TermFilter struct {
	// Job, if set, selects one job's terms.
	Job string
	// Group, if set, selects one consumer group's terms instead.
	Group string
	// Limit is the most terms returned. Default 20.
	Limit int
}

// Terms returns the most recent leadership terms of schema ("" means
// "pgfence") that f selects, newest first: a change of leader shows as a
// new term with a greater token, and the term before it says why it ended.
func Terms(ctx context.Context, db fence.DB, schema string, f TermFilter) ([]Term, error) {
	if err := ctxcheck.NotNil(ctx, "runner: Terms"); err != nil {
		return nil, err
	}
	if err := pgexec.NotNil(db, "runner: Terms"); err != nil {
		return nil, err
	}
	if err := ident.ValidateSchema(schema); err != nil {
		return nil, fmt.Errorf("runner: %w", err)
	}
	if f.Limit == 0 {
		f.Limit = 20
	}
	if f.Limit < 0 {
		return nil, fmt.Errorf("runner: TermFilter.Limit %d is negative", f.Limit)
	}
	if f.Job != "" && f.Group != "" {
		return nil, fmt.Errorf("runner: TermFilter: Job %q and Group %q both set", f.Job, f.Group)
	}
	kind, name := termJob, f.Job
	if f.Group != "" {
		kind, name = termGroup, f.Group
	}
	rows, err := db.Query(ctx, sqlFor(schema).terms, f.Limit, name, kind)
	if err != nil {
		return nil, fmt.Errorf("runner: read the terms: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	terms, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Term, error) {
		var (
			t                     Term
			tok                   int64
			ended, first, last, u *time.Time
		)
		err := r.Scan(&t.Job, &t.Shard, &tok, &t.Holder, &t.Started, &ended, &t.EndCause,
			&first, &last, &u, &t.Attempts, &t.Fenced, &t.Now)
		t.Token = fence.Token(tok)
		if kind == termGroup {
			t.Job, t.Group = "", t.Job
		}
		for _, c := range []struct {
			dst *time.Time
			src *time.Time
		}{{&t.Ended, ended}, {&t.FirstRun, first}, {&t.LastRun, last}, {&t.Until, u}} {
			if c.src != nil {
				*c.dst = *c.src
			}
		}
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("runner: read the terms: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	return terms, nil
}
