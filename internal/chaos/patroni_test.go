package chaos

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/patroni"
	"github.com/pgfence/pgfence/internal/pgcluster"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

// haLeaseTTL is the lease TTL of the clients on the Patroni cluster. With
// three hosts and connect_timeout=2 the renewer must be able to connect
// within the trust window's slack (TTL - SafetyMargin - RenewInterval).
const haLeaseTTL = 5 * time.Second

// haRig is pgfence running on a Patroni cluster as an application would:
// every client connects through the multi-host URL; a resource fence lives
// in a server of its own that never fails over.
type haRig struct {
	t      *testing.T
	ctx    context.Context
	url    string        // the cluster's multi-host URL
	bound  time.Duration // how long the cluster takes to replace a failed primary
	ledger *pgxpool.Pool
	res    fence.Resource
	logs   *pgtest.Logs

	mu       sync.Mutex
	issued   []issue                // every acquisition that returned, in order
	latest   map[string]*lock.Lease // the last acquisition of each lease
	progress []time.Time            // the election leader's committed writes
}

type issue struct {
	token fence.Token
	lease string
	at    time.Time
}

func (r *haRig) record(l *lock.Lease) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.issued = append(r.issued, issue{l.Token(), l.Name(), time.Now()})
	if r.latest == nil {
		r.latest = make(map[string]*lock.Lease)
	}
	r.latest[l.Name()] = l
}

// live waits until the last acquisition of lease is live (within), and
// returns it.
func (r *haRig) live(lease string, within time.Duration) *lock.Lease {
	r.t.Helper()
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		r.mu.Lock()
		l := r.latest[lease]
		r.mu.Unlock()
		if l != nil && l.Err() == nil {
			return l
		}
	}
	r.t.Fatalf("no live acquisition of %q for %v", lease, within)
	return nil
}

// count is the number of acquisitions of lease that returned so far.
func (r *haRig) count(lease string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, is := range r.issued {
		if is.lease == lease {
			n++
		}
	}
	return n
}

// maxIssued is the greatest token returned so far.
func (r *haRig) maxIssued() fence.Token {
	r.mu.Lock()
	defer r.mu.Unlock()
	var m fence.Token
	for _, is := range r.issued {
		m = max(m, is.token)
	}
	return m
}

// progressAfter is the time of the election leader's first committed
// write after t.
func (r *haRig) progressAfter(t time.Time) (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.progress {
		if s.After(t) {
			return s, true
		}
	}
	return time.Time{}, false
}

func (r *haRig) client(name string, logger *slog.Logger) *lock.Client {
	r.t.Helper()
	pool := connect(r.t, r.url)
	c, err := lock.New(pool, lock.Config{Schema: "pgfence", TTL: haLeaseTTL, Holder: name, Logger: logger})
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = c.Close(ctx)
	})
	return c
}

// write is a protected write made with l's token: a guarded insert into the
// register on the cluster, then a resource-fenced insert into the ledger.
// Errors are returned, not fatal: during a failover writes fail.
func (r *haRig) write(ctx context.Context, l *lock.Lease) error {
	err := l.RunTx(ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO ha_register (lease, token) VALUES ($1, $2)`, l.Name(), int64(l.Token()))
		return err
	})
	if err != nil {
		return fmt.Errorf("guarded write: %w", err)
	}
	return pgx.BeginFunc(ctx, r.ledger, func(tx pgx.Tx) error {
		if err := r.res.Admit(ctx, tx, l.Token()); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO ha_ledger (token, holder) VALUES ($1, $2)`, int64(l.Token()), l.Holder())
		return err
	})
}

// writeStep is write for a lease of a step. The election's leader writes
// to the same resource, and its lease draws from the same sequence: if it
// acquired after l and wrote first, the resource refuses l's smaller
// token, and that is the fence at work, not a failure. Any other error is
// returned, also a refusal by a token issued before l's (what the steps
// check: a token issued after a promotion below one issued before it).
func (r *haRig) writeStep(ctx context.Context, l *lock.Lease) error {
	err := r.write(ctx, l)
	var stale *fence.StaleTokenError
	if !errors.As(err, &stale) || stale.Resource == "" || stale.Presented != l.Token() {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	var own time.Time
	for _, is := range r.issued {
		if is.token == l.Token() {
			own = is.at
		}
	}
	for _, is := range r.issued {
		if is.token == stale.Current && is.lease != l.Name() && !own.IsZero() && is.at.After(own) {
			r.t.Logf("%s's write (token %d) was overtaken at the resource by %s's, acquired after it (token %d)", l.Name(), l.Token(), is.lease, is.token)
			return nil
		}
	}
	return err
}

// acquireAfterFailover acquires name through c, retrying until the cluster
// has a primary again, and checks that its token is above every token
// returned before.
func (r *haRig) acquireAfterFailover(c *lock.Client, name string, before fence.Token) *lock.Lease {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(r.ctx, r.bound+3*haLeaseTTL+30*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, name)
	if err != nil {
		r.t.Fatalf("acquire %s after the failover: %v", name, err)
	}
	r.record(l)
	if l.Token() <= before {
		r.t.Fatalf("token %d issued after the promotion is not above %d, issued before it", l.Token(), before)
	}
	return l
}

// churn acquires and releases name n times through c.
func (r *haRig) churn(c *lock.Client, name string, n int) {
	r.t.Helper()
	for range n {
		l, err := c.TryAcquire(r.ctx, name)
		if err != nil {
			r.t.Fatalf("acquire %s: %v", name, err)
		}
		r.record(l)
		if err := l.Release(r.ctx); err != nil {
			r.t.Fatal(err)
		}
	}
}

// newHARig applies the migrations on the cluster at url (whose failed
// primary is replaced within bound), creates the register there and the
// resource's ledger on a server of its own, and returns the rig and a pool
// on the cluster.
func newHARig(t *testing.T, ctx context.Context, url string, bound time.Duration) (*haRig, *pgxpool.Pool) {
	t.Helper()
	admin := connect(t, url)
	if _, err := migrations.Up(ctx, admin, "pgfence"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `CREATE TABLE ha_register (id bigserial PRIMARY KEY, lease text NOT NULL, token bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	_, ledger := migrated(t, ctx, "ledger")
	if _, err := ledger.Exec(ctx, `CREATE TABLE ha_ledger (id bigserial PRIMARY KEY, token bigint NOT NULL, holder text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	logs := pgtest.NewLogs()
	logs.LogOnFailure(t) // the election's log, with its times, if the run fails
	return &haRig{t: t, ctx: ctx, url: url, bound: bound, ledger: ledger, res: fence.Resource{Name: "ha", Schema: "ledger"}, logs: logs}, admin
}

// longestGap is the longest time between two committed writes of the
// election's leader (by send time) from the last one before from to the
// first one after to: how long there was no leader around a fault.
func (r *haRig) longestGap(from, to time.Time) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	var (
		gap  time.Duration
		prev time.Time
	)
	for _, s := range r.progress {
		if s.Before(from) {
			prev = s
			continue
		}
		if !prev.IsZero() {
			gap = max(gap, s.Sub(prev))
		}
		prev = s
		if s.After(to) {
			break
		}
	}
	return gap
}

// haElection is an Election campaigning on the rig's cluster; its leader
// writes every 200 ms and records each committed write's send time.
type haElection struct {
	r      *haRig
	ctx    context.Context // the run's: cancelled by cancel
	cancel context.CancelFunc
	runErr chan error // Run's result, taken once (by goesOn or stop)

	mu       sync.Mutex
	returned bool  // Run's result has been taken
	err      error // and was this
}

// result takes Run's result if it is there (wait: wait for it).
func (el *haElection) result(wait bool) (returned bool, err error) {
	el.mu.Lock()
	defer el.mu.Unlock()
	if !el.returned {
		if wait {
			el.err, el.returned = <-el.runErr, true
		} else {
			select {
			case el.err = <-el.runErr:
				el.returned = true
			default:
			}
		}
	}
	return el.returned, el.err
}

// elect starts the election; stop it with stop.
func (r *haRig) elect() *haElection {
	elected := r.client("elector", slog.New(r.logs))
	e := &lock.Election{Client: elected, Name: "leader", RetryDelay: 100 * time.Millisecond,
		Lead: func(ctx context.Context, l *lock.Lease) error {
			r.record(l)
			for ctx.Err() == nil {
				sent := time.Now()
				if r.write(ctx, l) == nil {
					r.mu.Lock()
					r.progress = append(r.progress, sent)
					r.mu.Unlock()
				}
				select {
				case <-ctx.Done():
				case <-time.After(200 * time.Millisecond):
				}
			}
			return nil
		}}
	el := &haElection{r: r, runErr: make(chan error, 1)}
	el.ctx, el.cancel = context.WithCancel(r.ctx)
	go func() { el.runErr <- e.Run(el.ctx) }()
	return el
}

// goesOn fails the test if Election.Run has returned.
func (el *haElection) goesOn(step string) {
	if returned, err := el.result(false); returned {
		el.r.t.Fatalf("Election.Run returned during the %s: %v", step, err)
	}
}

// back waits until the leader writes again after since and returns how
// long after since that write was sent (0 if since is zero). A leader
// writes again within the cluster's bound + the lease TTL + 15 s after a
// failover began (a leader whose lease survived the failover counts:
// renewals reach the promoted server, where the lease row is as
// replicated).
func (el *haElection) back(step string, since time.Time) time.Duration {
	el.r.t.Helper()
	within := el.r.bound + haLeaseTTL + 15*time.Second
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if s, ok := el.r.progressAfter(since); ok {
			if since.IsZero() {
				return 0
			}
			el.r.t.Logf("%s: the election's leader wrote again %v after the fault", step, s.Sub(since).Round(10*time.Millisecond))
			return s.Sub(since)
		}
		el.goesOn(step)
		time.Sleep(50 * time.Millisecond)
	}
	el.r.t.Fatalf("%s: the election's leader wrote nothing for %v", step, within)
	return 0
}

// stop stops the election and returns Run's error (the same on every
// call, and after goesOn saw Run return).
func (el *haElection) stop() error {
	el.cancel()
	_, err := el.result(true)
	return err
}

// checkHistory checks what the run left: no token issued twice, on any
// lease (one sequence serves them all); the resource fence never admitted
// one token for two holders, nor a lower token after a higher; guarded
// writes on the surviving history committed in token order per lease. It
// returns the acquisitions and the admitted writes.
func (r *haRig) checkHistory(admin *pgxpool.Pool) (acquisitions, admitted int) {
	r.t.Helper()
	// No token issued twice, on any lease (one sequence serves them all).
	r.mu.Lock()
	seen := map[fence.Token]issue{}
	for _, is := range r.issued {
		if prev, dup := seen[is.token]; dup {
			r.t.Errorf("token %d issued twice: %s at %v and %s at %v", is.token, prev.lease, prev.at, is.lease, is.at)
		}
		seen[is.token] = is
	}
	acquisitions = len(r.issued)
	r.mu.Unlock()
	// The resource fence: never one token for two holders, never lower after higher.
	rows, err := r.ledger.Query(r.ctx, `SELECT token, holder FROM ha_ledger ORDER BY id`)
	if err != nil {
		r.t.Fatal(err)
	}
	var (
		mark     int64
		holderOf = map[int64]string{}
	)
	for rows.Next() {
		var tok int64
		var holder string
		if err := rows.Scan(&tok, &holder); err != nil {
			r.t.Fatal(err)
		}
		admitted++
		if tok < mark {
			r.t.Errorf("the resource fence admitted %d after %d", tok, mark)
		}
		mark = max(mark, tok)
		if h, ok := holderOf[tok]; ok && h != holder {
			r.t.Errorf("the resource fence admitted token %d for %s and for %s", tok, h, holder)
		}
		holderOf[tok] = holder
	}
	if err := rows.Err(); err != nil {
		r.t.Fatal(err)
	}
	// Guarded writes on the surviving history commit in token order per lease.
	var outOfOrder int
	if err := admin.QueryRow(r.ctx, `SELECT count(*) FROM (
  SELECT token < max(token) OVER (PARTITION BY lease ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS stale
    FROM ha_register) s WHERE stale`).Scan(&outOfOrder); err != nil {
		r.t.Fatal(err)
	}
	if outOfOrder != 0 {
		r.t.Errorf("%d guarded writes committed after a write with a greater token", outOfOrder)
	}
	return acquisitions, admitted
}

// checkWarnings checks that each component warned once per failure period
// (at most failovers + 1 times), not per retry, and returns the warnings
// counted, for the log.
func (r *haRig) checkWarnings(failovers int) []string {
	r.t.Helper()
	counts := map[string]int{}
	for _, rec := range r.logs.Find(slog.LevelWarn, "") {
		if rec.Message != "pgfence: lease lost" {
			counts[rec.Message]++
		}
	}
	var msgs []string
	for m, k := range counts {
		msgs = append(msgs, fmt.Sprintf("%d x %q", k, m))
		if k > failovers+1 {
			r.t.Errorf("%d warnings %q over %d failovers: want at most one per failure period", k, m, failovers)
		}
	}
	sort.Strings(msgs)
	return msgs
}

// TestPatroniFailovers runs pgfence on a real Patroni cluster through
// every kind of failover in turn, while an Election campaigns and writes
// through the whole run: a crash with replication stalled (acquisitions
// really lost), a planned switchover, a split brain (the old primary's
// Patroni frozen, its PostgreSQL still accepting writes), a double failover
// (a replica that never followed the first promotion promoted after the
// first promoted node crashed: both pick the same timeline ID) and a last
// crash. Checked: no token is ever issued twice, every token after each
// promotion is above every token seen before it, the resource fence never
// admits one token for two acquisitions nor a lower token after a higher,
// no guarded write commits out of order, the Election never gives up, a
// leader is back within Patroni's ttl + the lease TTL + slack, and each
// component warns at most once per failure period.
func TestPatroniFailovers(t *testing.T) {
	ctx := pgtest.Context(t, 12*time.Minute)
	pc, err := patroni.Start(ctx)
	pgtest.NeedTool(t, err, patroni.ErrMissing, pgcluster.ErrNoServer)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for i := range patroni.Nodes {
				t.Logf("%s's log tail:\n%s", pc.Node(i).Name, pc.Node(i).Logs())
			}
		}
		_ = pc.Close()
	})
	r, admin := newHARig(t, ctx, pc.URL(), patroni.TTL)
	// The election runs through every failover below.
	el := r.elect()
	defer el.stop()
	runGoesOn := el.goesOn
	leaderBack := el.back
	runCtx, stopRun := el.ctx, el.cancel
	// Two runner replicas charge once a second throughout: the ledger must
	// keep every slot to one charge across the failovers.
	if _, err := admin.Exec(ctx, `CREATE TABLE ha_charges (id bigserial PRIMARY KEY, slot timestamptz NOT NULL, token bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	var replicas sync.WaitGroup
	for i := range 2 {
		rc, err := lock.New(connect(t, pc.URL()), lock.Config{Schema: "pgfence", TTL: haLeaseTTL,
			Holder: fmt.Sprintf("runner-%d", i), Logger: pgtest.Quiet})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rc.Close(context.Background()) })
		rn, err := runner.New(rc, runner.Config{})
		if err != nil {
			t.Fatal(err)
		}
		if err := rn.Register(runner.Job{Name: "charge", Schedule: "@every 1s", Missed: runner.Skip,
			Run: func(ctx context.Context, run *runner.Run) error {
				return run.CommitTx(ctx, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `INSERT INTO ha_charges (slot, token) VALUES ($1, $2)`, run.Slot, int64(run.Token))
					return err
				})
			}}); err != nil {
			t.Fatal(err)
		}
		replicas.Add(1)
		go func() {
			defer replicas.Done()
			_ = rn.Run(runCtx)
		}()
	}
	defer func() { stopRun(); replicas.Wait() }()
	steps := r.client("steps", pgtest.Quiet)
	r.churn(steps, "step", 5)
	leaderBack("start", time.Time{})
	failovers := 0
	leader := func() *patroni.Node {
		t.Helper()
		n, err := pc.WaitLeader(ctx, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	step := func(name string, f func()) {
		t.Logf("--- %s", name)
		f()
	}

	step("crash with replication stalled", func() {
		old := leader()
		if err := old.StallSending(); err != nil {
			t.Fatal(err)
		}
		// 40 acquisitions unreplicated: the token sequence WAL-logs 32
		// values ahead, so the replicas lack tokens the old primary issued.
		r.churn(steps, "step", 40)
		before := r.maxIssued()
		r.mu.Lock()
		acked := len(r.progress)
		r.mu.Unlock()
		crashed := time.Now()
		if err := old.Crash(); err != nil {
			t.Fatal(err)
		}
		next, err := pc.WaitLeader(ctx, patroni.TTL+30*time.Second, old)
		if err != nil {
			t.Fatal(err)
		}
		// What asynchronous replication lost: the acquisitions the new
		// primary does not have.
		var have int64
		if err := connect(t, next.URL()).QueryRow(ctx, `SELECT token FROM pgfence.pgfence_leases WHERE name = 'step'`).Scan(&have); err != nil {
			t.Fatal(err)
		}
		lost := 0
		r.mu.Lock()
		for _, is := range r.issued {
			if is.lease == "step" && int64(is.token) > have {
				lost++
			}
		}
		r.mu.Unlock()
		t.Logf("crash: %d acquisitions lost with the unreplicated WAL (the new primary has token %d)", lost, have)
		l := r.acquireAfterFailover(steps, "step", before)
		failovers++
		leaderBack("crash", crashed)
		// And the election leader's acknowledged guarded writes it lacks.
		var kept int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM ha_register WHERE lease = 'leader' AND token <= $1`, int64(before)).Scan(&kept); err != nil {
			t.Fatal(err)
		}
		t.Logf("crash: %d of %d acknowledged guarded writes lost; new primary's first token %d, above %d", acked-kept, acked, l.Token(), before)
		_ = l.Release(ctx)
		if err := old.Start(); err != nil { // rejoins through pg_rewind
			t.Fatal(err)
		}
		if err := pc.WaitReplicas(ctx, 90*time.Second, 2); err != nil {
			t.Fatal(err)
		}
	})

	step("switchover", func() {
		old := leader()
		before := r.maxIssued()
		// The election's term may have ended in the crash before, and the
		// next one may not have begun yet: the check below is about a
		// term that is live when the switchover begins.
		held := r.live("leader", r.bound+haLeaseTTL+15*time.Second)
		terms := r.count("leader")
		began := time.Now()
		if err := pc.Switchover(old, pc.Others(old)[0]); err != nil {
			t.Fatal(err)
		}
		took := time.Since(began) // Patroni answers once the switchover is done
		t.Logf("switchover: Patroni answered after %v", took.Round(10*time.Millisecond))
		l := r.acquireAfterFailover(steps, "step", before)
		failovers++
		leaderBack("switchover", began)
		// The old primary shuts down cleanly, so the new one has the
		// election's lease row: its renewals reach it and the term goes on,
		// if the cluster was without a primary for less than the trust
		// window's slack (TTL - SafetyMargin - RenewInterval, by default).
		// A switchover that took longer may end the lease at its trust
		// deadline, as it should.
		slack := haLeaseTTL - haLeaseTTL/10 - haLeaseTTL/3
		if got := r.count("leader"); got != terms {
			// Its session's expiry as the promoted server has it, against
			// the one its last successful renewal returned: a renewal the
			// old primary committed but the promoted standby never
			// replayed makes the session expire earlier there, and the
			// lease rightly ends (asynchronous replication; Patroni
			// promotes a standby within maximum_lag_on_failover).
			// told first: a renewal of the session after it only moves
			// the server's expiry later.
			told := held.ExpiresAt()
			var there *time.Time
			if err := admin.QueryRow(ctx, `SELECT max(expires_at) FROM pgfence.pgfence_sessions
 WHERE holder = 'elector' AND started_at < $1`, began).Scan(&there); err != nil || there == nil {
				t.Fatalf("the election's session on the promoted server: %v, %v", there, err)
			}
			switch there := *there; {
			case there.Before(told):
				t.Logf("switchover: the promoted server lacks the session's last renewals (its expiry there %s, the client's last renewal %s): "+
					"the election's lease ended with them", there.Format(time.StampMilli), told.Format(time.StampMilli))
			case took < slack:
				t.Errorf("the election's leader lost its lease in a switchover of %v: %d terms, then %d (its session expires at %s there, at %s by its last renewal)",
					took.Round(10*time.Millisecond), terms, got, there.Format(time.StampMilli), told.Format(time.StampMilli))
			default:
				t.Logf("the switchover took %v, more than the trust window's slack (%v): the election's lease ended, a new term began", took.Round(10*time.Millisecond), slack.Round(10*time.Millisecond))
			}
		}
		_ = l.Release(ctx)
		if err := pc.WaitReplicas(ctx, 90*time.Second, 2); err != nil {
			t.Fatal(err)
		}
	})

	step("split brain", func() {
		old := leader()
		// A leader connected to the old primary alone: it stays there.
		direct := connect(t, old.URL())
		zc, err := lock.New(direct, lock.Config{Schema: "pgfence", TTL: haLeaseTTL, Holder: "zombie", Logger: pgtest.Quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = zc.Close(context.Background()) }()
		zombie, err := zc.TryAcquire(ctx, "split")
		if err != nil {
			t.Fatal(err)
		}
		r.record(zombie)
		if err := r.writeStep(ctx, zombie); err != nil {
			t.Fatal(err)
		}
		before := r.maxIssued()
		if err := old.Freeze(); err != nil {
			t.Fatal(err)
		}
		began := time.Now()
		next, err := pc.WaitLeader(ctx, patroni.TTL+30*time.Second, old)
		if err != nil {
			t.Fatal(err)
		}
		onNew := connect(t, next.URL())
		nc, err := lock.New(onNew, lock.Config{Schema: "pgfence", TTL: haLeaseTTL, Holder: "new", Logger: pgtest.Quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = nc.Close(context.Background()) }()
		fresh := r.acquireAfterFailover(nc, "split", before)
		failovers++
		if err := r.writeStep(ctx, fresh); err != nil {
			t.Fatalf("the new leader's write: %v", err)
		}
		// The zombie still holds its lease on the old primary, which still
		// accepts writes: only the resource fence stands in its way.
		if err := zombie.Check(ctx); err != nil {
			t.Fatalf("the zombie's lease on the old primary: %v", err)
		}
		if err := r.write(ctx, zombie); !errors.Is(err, fence.ErrFenced) {
			t.Fatalf("the resource fence admitted the zombie (token %d) after the new leader (%d): %v", zombie.Token(), fresh.Token(), err)
		}
		_ = fresh.Release(ctx)
		// The election's leader may be a zombie too, on the old primary:
		// its writes are refused until Patroni demotes the old primary.
		if err := old.Thaw(); err != nil { // Patroni demotes it and rewinds it
			t.Fatal(err)
		}
		leaderBack("split brain", began)
		if err := pc.WaitReplicas(ctx, 90*time.Second, 2); err != nil {
			t.Fatal(err)
		}
	})

	step("double failover", func() {
		a := leader()
		b, c := pc.Others(a)[0], pc.Others(a)[1]
		// c takes no part: its replica keeps following a.
		if err := c.Freeze(); err != nil {
			t.Fatal(err)
		}
		before := r.maxIssued()
		crashed := time.Now()
		if err := a.Crash(); err != nil {
			t.Fatal(err)
		}
		if _, err := pc.WaitLeader(ctx, patroni.TTL+30*time.Second, a); err != nil {
			t.Fatal(err)
		}
		onB := r.acquireAfterFailover(steps, "step", before)
		if err := r.writeStep(ctx, onB); err != nil {
			t.Fatalf("write on b: %v", err)
		}
		_ = onB.Release(ctx)
		onB2 := r.acquireAfterFailover(steps, "step", onB.Token())
		failovers++
		tlB, err := b.Timeline(ctx)
		if err != nil {
			t.Fatal(err)
		}
		beforeC := r.maxIssued()
		time.Sleep(500 * time.Millisecond)
		crashedB := time.Now()
		if err := b.Crash(); err != nil {
			t.Fatal(err)
		}
		_ = onB2 // lost with b
		if err := c.Thaw(); err != nil {
			t.Fatal(err)
		}
		if _, err := pc.WaitLeader(ctx, patroni.TTL+60*time.Second, a, b); err != nil {
			t.Fatal(err)
		}
		onC := r.acquireAfterFailover(steps, "step", beforeC)
		failovers++
		tlC, err := c.Timeline(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("double failover: b on timeline %d issued up to %d; c on timeline %d issued %d", tlB, beforeC, tlC, onC.Token())
		if tlC != tlB {
			t.Logf("c did not reuse b's timeline (%d vs %d): the scenario was not staged this time", tlC, tlB)
		}
		if err := r.writeStep(ctx, onC); err != nil {
			t.Fatalf("write on c: %v", err)
		}
		_ = onC.Release(ctx)
		t.Logf("double failover: %v from the first crash to c's first token", time.Since(crashed).Round(10*time.Millisecond))
		leaderBack("double failover", crashedB)
		if err := a.Start(); err != nil {
			t.Fatal(err)
		}
		if err := b.Start(); err != nil {
			t.Fatal(err)
		}
		if err := pc.WaitReplicas(ctx, 120*time.Second, 1); err != nil {
			t.Fatal(err)
		}
	})

	step("last crash", func() {
		old := leader()
		before := r.maxIssued()
		crashed := time.Now()
		if err := old.Crash(); err != nil {
			t.Fatal(err)
		}
		l := r.acquireAfterFailover(steps, "step", before)
		failovers++
		leaderBack("last crash", crashed)
		_ = l.Release(ctx)
	})
	runGoesOn("run")
	if err := el.stop(); err != nil {
		t.Fatalf("Election.Run: %v", err)
	}

	n, admitted := r.checkHistory(admin)
	// Every slot charged once, and only by a run the ledger records.
	stopRun()
	replicas.Wait()
	var charged, twice, unrecorded int
	if err := admin.QueryRow(ctx, `SELECT count(*), count(*) - count(DISTINCT slot),
       count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM pgfence.pgfence_runs r
                                           WHERE r.job = 'charge' AND r.slot = c.slot AND r.status = 'succeeded' AND r.token = c.token))
  FROM ha_charges c`).Scan(&charged, &twice, &unrecorded); err != nil {
		t.Fatal(err)
	}
	if charged == 0 || twice != 0 || unrecorded != 0 {
		t.Errorf("runner across the failovers: %d charges, %d slots charged twice, %d charges without their succeeded run", charged, twice, unrecorded)
	}
	t.Logf("runner: %d slots charged once each across the failovers", charged)
	msgs := r.checkWarnings(failovers)
	t.Logf("%d failovers, %d acquisitions, %d resource-fenced writes; the election's warnings: %v", failovers, n, admitted, msgs)
}
