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
	// leads them), and Roles the roles.
	Jobs  []string `json:"jobs"`
	Roles []string `json:"roles"`
	// Leads lists the jobs and shards whose lease the instance holds, and
	// Partitions the roles' partitions.
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

// PartitionLead is one partition of a role an instance leads, with its
// lease token.
type PartitionLead struct {
	Role      string      `json:"role"`
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
	rows, err := db.Query(ctx, sqlFor(schema).instances, jobLeasePrefix, roleLeasePrefix)
	if err != nil {
		return nil, fmt.Errorf("runner: read the instances: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	infos, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (InstanceInfo, error) {
		var (
			ii                   InstanceInfo
			registered           []string
			jobs, roles          []string
			shards, parts        []int
			tokens, partitionTok []int64
		)
		err := r.Scan(&ii.ID, &ii.StartedAt, &ii.HeartbeatAt, &ii.ExpiresAt, &ii.Live, &ii.StoppedAt, &registered,
			&jobs, &shards, &tokens, &roles, &parts, &partitionTok, &ii.Now)
		ii.Jobs, ii.Roles = []string{}, []string{}
		for _, name := range registered {
			if role, ok := strings.CutPrefix(name, roleLeasePrefix); ok {
				ii.Roles = append(ii.Roles, role)
			} else {
				ii.Jobs = append(ii.Jobs, name)
			}
		}
		ii.Leads, ii.Partitions = []Lead{}, []PartitionLead{}
		for i := range jobs {
			ii.Leads = append(ii.Leads, Lead{Job: jobs[i], Shard: shards[i], Token: fence.Token(tokens[i])})
		}
		for i := range roles {
			ii.Partitions = append(ii.Partitions, PartitionLead{Role: roles[i], Partition: parts[i], Token: fence.Token(partitionTok[i])})
		}
		return ii, err
	})
	if err != nil {
		return nil, fmt.Errorf("runner: read the instances: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	return infos, nil
}

// Term is one leadership term of a job (shard) as the ledger records it:
// the token its leader ran attempts with, and when.
type Term struct {
	Job    string      `json:"job"`
	Shard  int         `json:"shard"`
	Token  fence.Token `json:"token"`
	Holder string      `json:"holder"`
	// FirstRun and LastRun are when the term's first and latest attempts
	// started; Attempts counts them.
	FirstRun time.Time `json:"first_run"`
	LastRun  time.Time `json:"last_run"`
	Attempts int       `json:"attempts"`
	// Until is when the term's last attempt to end ended (an attempt that
	// still runs counts from its start): the term's last sign of life in
	// the ledger.
	Until time.Time `json:"until"`
	// Fenced counts the term's attempts refused as stale or taken over.
	Fenced int `json:"fenced"`
}

// TermFilter selects terms for Terms. The zero value selects the 20 most
// recent terms of every job.
type TermFilter struct {
	// Job, if set, selects one job's terms.
	Job string
	// Limit is the most terms returned. Default 20.
	Limit int
}

// Terms returns the most recent leadership terms recorded in the ledger of
// schema ("" means "pgfence") that f selects, newest first: a change of
// leader shows as a new term with a greater token. A term in
// which no attempt ran is not in the ledger; the current leader of each job
// is in Jobs.
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
	rows, err := db.Query(ctx, sqlFor(schema).terms, f.Limit, f.Job)
	if err != nil {
		return nil, fmt.Errorf("runner: read the terms: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	terms, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Term, error) {
		var (
			t   Term
			tok int64
		)
		err := r.Scan(&t.Job, &t.Shard, &tok, &t.Holder, &t.FirstRun, &t.LastRun, &t.Until, &t.Attempts, &t.Fenced)
		t.Token = fence.Token(tok)
		return t, err
	})
	if err != nil {
		return nil, fmt.Errorf("runner: read the terms: %w", hint.Wrap(err, schema, hint.Role(db)))
	}
	return terms, nil
}
