package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/netns"
	"github.com/pgfence/pgfence/internal/pgcluster"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

// The network-partition nemesis: library calls run in a worker process
// inside a network namespace of its own (internal/netns), against a private
// server reached through the namespace's link, and the test cuts that link
// with nftables rules at chosen moments (partition_worker_test.go says what
// each scenario does). No proxy: the worker's kernel retransmits into a
// black hole, or sees its answers lost, or its connections reset, as in a
// real partition. Every call's return is checked against its deadline, and
// every answer about a write against the table.

// lateBound is how long after its context's deadline a call may return.
const lateBound = time.Second

// partitionRig is a private server that listens on a namespace's link.
type partitionRig struct {
	t       *testing.T
	host    *netns.Host
	cluster *pgcluster.Cluster
	admin   *pgxpool.Pool
	marker  atomic.Int64
}

func newPartitionRig(t *testing.T) *partitionRig {
	t.Helper()
	h, err := netns.New()
	pgtest.NeedTool(t, err, netns.ErrUnavailable)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Close(); err != nil {
			t.Error(err)
		}
	})
	c, err := pgcluster.NewTrusting([]string{h.Addr.String() + "/32"}, fmt.Sprintf("listen_addresses = '127.0.0.1, %s'", h.Gateway))
	pgtest.NeedTool(t, err, pgcluster.ErrNoServer)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	admin, err := pgxpool.New(ctx, c.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	if _, err := migrations.Up(ctx, admin, "pgfence"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `CREATE SCHEMA data; CREATE TABLE data.partitioned (marker bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return &partitionRig{t: t, host: h, cluster: c, admin: admin}
}

func (r *partitionRig) cut(f netns.Fault) {
	r.t.Helper()
	if err := r.host.Cut(f); err != nil {
		r.t.Fatal(err)
	}
}

func (r *partitionRig) heal() {
	r.t.Helper()
	if err := r.host.Heal(); err != nil {
		r.t.Fatal(err)
	}
}

// client is a lock client of the test's own, outside the partition.
func (r *partitionRig) client(ttl time.Duration) *lock.Client {
	r.t.Helper()
	c, err := lock.New(r.admin, lock.Config{Schema: "pgfence", TTL: ttl, RenewInterval: ttl / 4,
		PollInterval: 50 * time.Millisecond, Holder: "outside", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// worker is a partition worker process and the test's side of its
// conversation.
type worker struct {
	t      *testing.T
	in     io.WriteCloser
	lines  chan msg
	stderr syncBuffer
	exited chan struct{}
}

// start runs a scenario in a worker process inside the rig's namespace.
func (r *partitionRig) start(scenario string, env ...string) *worker {
	t := r.t
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := r.host.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=partition", "PART_SCENARIO="+scenario,
		"PART_URL="+r.cluster.URLAt(r.host.Gateway.String()))
	cmd.Env = append(cmd.Env, env...)
	w := &worker{t: t, lines: make(chan msg, 16), exited: make(chan struct{})}
	cmd.Stderr = &w.stderr
	if w.in, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(w.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var m msg
			if json.Unmarshal(sc.Bytes(), &m) == nil {
				w.lines <- m
			}
		}
	}()
	go func() { _ = cmd.Wait(); close(w.exited) }()
	t.Cleanup(func() {
		_ = w.in.Close()
		select {
		case <-w.exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-w.exited
		}
	})
	return w
}

// next waits for the worker's next step, which must be step.
func (w *worker) next(step string) msg {
	w.t.Helper()
	select {
	case m, ok := <-w.lines:
		if !ok {
			w.t.Fatalf("worker ended before %q:\n%s", step, w.stderr.String())
		}
		if m["step"] != step {
			w.t.Fatalf("worker said %v, want step %q", m, step)
		}
		return m
	case <-time.After(2 * time.Minute):
		w.t.Fatalf("no step %q from the worker in 2 minutes:\n%s", step, w.stderr.String())
	}
	return nil
}

// ack lets the worker go on from an await.
func (w *worker) ack() {
	w.t.Helper()
	if _, err := io.WriteString(w.in, "\n"); err != nil {
		w.t.Fatal(err)
	}
}

// onTime fails the test if the call m reports returned more than lateBound
// after its deadline.
func onTime(t *testing.T, what string, m msg) {
	t.Helper()
	ms, ok := m["late_ms"].(float64)
	if !ok {
		t.Fatalf("%s: the worker's report has no time: %v", what, m)
	}
	late := time.Duration(ms * float64(time.Millisecond))
	t.Logf("%s: returned %v after its deadline (err: %v)", what, late.Round(time.Millisecond), m["err"])
	if late > lateBound {
		t.Errorf("%s returned %v after its context's deadline (at most %v): %v", what, late.Round(time.Millisecond), lateBound, m["err"])
	}
}

// settle waits until the server has no session of the worker's left (its
// connections closed, or reset, once the network healed), ending them
// after a while, so that what the table holds is final.
func (r *partitionRig) settle() {
	r.t.Helper()
	ctx := context.Background()
	const q = `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'partition-worker'`
	deadline := time.Now().Add(20 * time.Second)
	for {
		var n int
		if err := r.admin.QueryRow(ctx, q).Scan(&n); err != nil {
			r.t.Fatal(err)
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline.Add(10 * time.Second)) {
			r.t.Fatalf("%d sessions of the worker still there 10 s after they were ended", n)
		}
		if time.Now().After(deadline) {
			_, _ = r.admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'partition-worker'`)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// committed reports whether the marker's row is in the table.
func (r *partitionRig) committed(marker int64) bool {
	r.t.Helper()
	var n int
	if err := r.admin.QueryRow(context.Background(), `SELECT count(*) FROM data.partitioned WHERE marker = $1`, marker).Scan(&n); err != nil {
		r.t.Fatal(err)
	}
	return n > 0
}

// TestPartitionedGuardedTx cuts a guarded transaction's network while its
// function is inside it, under each fault, and ends the function each way:
// its own error, a return into the partition (COMMIT sent into it), a
// return after the heal, and a statement that cannot finish. RunTx must
// return within a second of its deadline, and its answer must be true
// against the table: nil only if the row committed, an outcome-unknown
// error resolvable after the heal to the truth, anything else only if it
// did not commit.
func TestPartitionedGuardedTx(t *testing.T) {
	rig := newPartitionRig(t)
	ends := []string{"own-error", "commit", "after-heal", "blocked"}
	for _, fault := range netns.Faults {
		for _, end := range ends {
			t.Run(fault.String()+"/"+end, func(t *testing.T) {
				rig.t = t
				marker := rig.marker.Add(1)
				w := rig.start("tx", "PART_END="+end, fmt.Sprintf("PART_MARKER=%d", marker), "PART_BUDGET=3s")
				w.next("inside")
				rig.cut(fault)
				cutAt := time.Now()
				w.ack()
				if end == "after-heal" {
					w.next("partitioned")
					// A partition of a second and a half, well inside the budget.
					time.Sleep(time.Until(cutAt.Add(1500 * time.Millisecond)))
					rig.heal()
					w.ack()
				}
				res := w.next("returned")
				onTime(t, "RunTx", res)
				rig.heal()
				w.ack()
				var resolved msg
				if res["unknown"] == true {
					resolved = w.next("resolved")
				}
				w.next("bye")
				rig.settle()
				in := rig.committed(marker)
				t.Logf("committed: %v; RunTx: ok=%v unknown=%v err=%v", in, res["ok"], res["unknown"], res["err"])
				switch {
				case res["ok"] == true && !in:
					t.Errorf("RunTx returned nil, and the row is not in the table")
				case res["unknown"] == true:
					t.Logf("resolved after the heal: ok=%v err=%v", resolved["ok"], resolved["err"])
					switch {
					case resolved["unknown"] == true:
						t.Errorf("the outcome was still unknown once the network had healed: %v", resolved["err"])
					case resolved["ok"] == true && !in:
						t.Errorf("the unknown outcome resolved to committed, and the row is not in the table")
					case resolved["ok"] != true && in:
						t.Errorf("the unknown outcome resolved to not committed (%v), and the row is in the table", resolved["err"])
					}
				case res["ok"] != true && in:
					t.Errorf("RunTx returned %v (not committed), and the row is in the table", res["err"])
				}
				if end == "own-error" && res["own"] != true {
					t.Errorf("RunTx returned %v, want the function's own error", res["err"])
				}
				if end == "own-error" && in {
					t.Errorf("a transaction whose function returned an error committed")
				}
			})
		}
	}
}

// TestPartitionedHolder cuts a holder off under each fault while it holds
// a lease: it must stop trusting the lease before anyone else is granted it
// (no overlap of belief), the next holder must have it within the takeover
// bound, and the old holder's guarded write after the heal must be
// refused.
func TestPartitionedHolder(t *testing.T) {
	rig := newPartitionRig(t)
	const ttl, poll = 2 * time.Second, 100 * time.Millisecond
	for _, fault := range netns.Faults {
		t.Run(fault.String(), func(t *testing.T) {
			rig.t = t
			if _, err := rig.admin.Exec(context.Background(), `UPDATE pgfence.pgfence_leases SET holder = NULL WHERE name = 'held'`); err != nil {
				t.Fatal(err)
			}
			outside := rig.client(ttl)
			w := rig.start("hold", "PART_TTL="+ttl.String(), "PART_POLL="+poll.String())
			w.next("held")
			rig.cut(fault)
			cutAt := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			l, err := outside.Acquire(ctx, "held")
			if err != nil {
				t.Fatal(err)
			}
			granted := time.Now()
			lost := w.next("lost")
			lostAt := time.Unix(0, int64(lost["at"].(float64)))
			t.Logf("stopped trusting %v into the partition (%v), taken over %v into it, %v later",
				lostAt.Sub(cutAt).Round(time.Millisecond), lost["err"], granted.Sub(cutAt).Round(time.Millisecond),
				granted.Sub(lostAt).Round(time.Millisecond))
			if !lostAt.Before(granted) {
				t.Errorf("the partitioned holder still trusted its lease %v after the next holder was granted it", lostAt.Sub(granted))
			}
			// Its renewals may still reach the server when only the
			// replies are lost: the lease then lasts a TTL past its
			// holder's last one.
			bound := ttl + poll + time.Second
			if fault == netns.DropReplies {
				bound += ttl
			}
			if took := granted.Sub(cutAt); took > bound {
				t.Errorf("the next holder was granted the lease %v into the partition, more than %v", took, bound)
			}
			rig.heal()
			w.ack()
			write := w.next("write")
			if write["fenced"] != true {
				t.Errorf("the old holder's guarded write after the heal: %v, want refused (fence.ErrFenced)", write["err"])
			}
			w.next("bye")
			_ = l.Release(ctx)
		})
	}
}

// TestPartitionedCalls makes each call that talks to the database from a
// client cut off by a black hole (and by lost replies), with a 1 s deadline
// or with a context that has already ended (a cleanup at shutdown), and a
// ForceRelease already waiting at the server when the cut comes: each must
// return within a second of its deadline.
func TestPartitionedCalls(t *testing.T) {
	rig := newPartitionRig(t)
	outside := rig.client(10 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	held, err := outside.Acquire(ctx, "ops-root")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = held.Release(ctx) }()
	for _, fault := range []netns.Fault{netns.DropBoth, netns.DropReplies} {
		t.Run(fault.String(), func(t *testing.T) {
			rig.t = t
			// A guarded transaction open on the lease: a ForceRelease
			// waits for it.
			tx, err := rig.admin.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			if err := held.Guard().Check(ctx, tx); err != nil {
				t.Fatal(err)
			}
			// A TTL long enough that the leases are still held, locally,
			// when the last call is made.
			w := rig.start("ops", "PART_BUDGET=1s", "PART_TTL=1m", "PART_TAG="+fault.String())
			w.next("held")
			pgtest.Eventually(t, 30*time.Second, "the ForceRelease to wait at the server", func() bool {
				var n int
				err := rig.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
					WHERE application_name = 'partition-worker' AND wait_event_type = 'Lock'`).Scan(&n)
				return err == nil && n > 0
			})
			rig.cut(fault)
			defer rig.heal()
			w.ack()
			for _, call := range []string{"release", "release-ended", "check", "acquire", "try-acquire", "observe", "inspect",
				"leases", "run-now", "pause", "resume", "jobs", "grant-app", "migrate", "close-ended", "force-release"} {
				m := w.next(call)
				onTime(t, call, m)
				// The partition took effect: a call with a live deadline
				// waited for it (it did not fail early for another reason).
				if !strings.HasSuffix(call, "-ended") && m["late_ms"].(float64) < -100 {
					t.Errorf("%s returned %v ms before its deadline, cut off: %v", call, -m["late_ms"].(float64), m["err"])
				}
			}
			rig.heal()
			w.next("bye")
		})
	}
}

// TestPartitionedListener cuts a waiting client off, black-holed: its
// listening connection gets no notification and no error, and the client
// must give it up within two TTLs (a ping after a TTL of quiet that does not
// come back within a TTL). After the heal, a release must reach the waiter,
// which polls only every 30 s, well before its next poll: through a
// listening connection opened anew.
func TestPartitionedListener(t *testing.T) {
	rig := newPartitionRig(t)
	const ttl = 2 * time.Second
	outside := rig.client(ttl)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	held, err := outside.Acquire(ctx, "waited")
	if err != nil {
		t.Fatal(err)
	}
	w := rig.start("listen", "PART_TTL="+ttl.String(), "PART_POLL=30s", "PART_LOG=1")
	w.next("waiting")
	const listening = `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'partition-worker' AND query LIKE 'LISTEN%'`
	count := func() int {
		var n int
		if err := rig.admin.QueryRow(ctx, listening).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	pgtest.Eventually(t, 30*time.Second, "the waiter's listening session", func() bool { return count() == 1 })
	before := len(w.stderr.String()) // only what the worker logs from the cut on counts
	rig.cut(netns.DropBoth)
	cutAt := time.Now()
	const failed = "release listener failed"
	bound := 2*ttl + time.Second
	pgtest.Eventually(t, bound+5*time.Second, "the waiter to give its listening connection up", func() bool {
		return strings.Contains(w.stderr.String()[before:], failed)
	})
	noticed := time.Since(cutAt)
	t.Logf("the listening connection was given up %v into the partition", noticed.Round(time.Millisecond))
	if noticed > bound {
		t.Errorf("the listening connection was given up %v into the partition, more than %v", noticed, bound)
	}
	rig.heal()
	// The old session ends when the server next writes to it; the new one
	// is what matters.
	pgtest.Eventually(t, 30*time.Second, "a new listening session", func() bool {
		return strings.Contains(w.stderr.String()[before:], "release listener listening again")
	})
	released := time.Now()
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	got := w.next("acquired")
	at := time.Unix(0, int64(got["at"].(float64)))
	t.Logf("the waiter acquired the lease %v after its release (%v)", at.Sub(released).Round(time.Millisecond), got["err"])
	if got["ok"] != true {
		t.Fatalf("the waiter's Acquire: %v", got["err"])
	}
	// Its next poll is 30 s away: only the notification wakes it sooner
	// (10 s leaves room for a loaded machine).
	if d := at.Sub(released); d > 10*time.Second {
		t.Errorf("the waiter acquired the lease %v after its release: the release notification did not reach it", d)
	}
	w.next("bye")
}

// syncBuffer is a worker's stderr, read while the worker writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// TestPartitionedLeader cuts a runner's leader off, black-holed, in the
// middle of a run: another replica must take the job over and run the
// interrupted slot once, within the takeover bound, and the zombie's late
// CommitTx after the heal must be refused.
func TestPartitionedLeader(t *testing.T) {
	rig := newPartitionRig(t)
	const ttl = 2 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := rig.admin.Exec(ctx, `CREATE TABLE data.runs (slot timestamptz NOT NULL, by text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	w := rig.start("leader", "PART_TTL="+ttl.String())
	// A manual run, asked for once the worker's runner has registered the
	// job (its schedule is hours away).
	pgtest.Eventually(t, 30*time.Second, "the worker's runner to register the job", func() bool {
		_, err := runner.RunNow(ctx, rig.admin, "pgfence", "partitioned-job", 0, "test")
		return err == nil
	})
	running := w.next("running")
	slot, err := time.Parse(time.RFC3339Nano, running["slot"].(string))
	if err != nil {
		t.Fatal(err)
	}
	rig.cut(netns.DropBoth)
	cutAt := time.Now()

	// The other replica starts once the leader is cut off, so that no
	// rebalance hands the job over before.
	took := make(chan time.Time, 1)
	r, err := runner.New(rig.client(ttl), runner.Config{RebalanceInterval: time.Second, ShutdownTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	err = r.Register(runner.Job{Name: "partitioned-job", Schedule: "@every 1h", Run: func(ctx context.Context, run *runner.Run) error {
		select {
		case took <- time.Now():
		default:
		}
		return run.CommitTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO data.runs (slot, by) VALUES ($1, 'outside')", run.Slot)
			return err
		})
	}})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- r.Run(rctx) }()
	defer func() { stop(); <-stopped }()

	var ran time.Time
	select {
	case ran = <-took:
	case <-ctx.Done():
		t.Fatal("the other replica never ran the job")
	}
	fenced := w.next("fenced")
	fencedAt := time.Unix(0, int64(fenced["at"].(float64)))
	t.Logf("the leader's run was cancelled %v into the partition (%v); the other replica ran the slot %v into it",
		fencedAt.Sub(cutAt).Round(time.Millisecond), fenced["err"], ran.Sub(cutAt).Round(time.Millisecond))
	if !fencedAt.Before(ran) {
		t.Errorf("the cut-off leader's run was still live %v after the other replica's began", fencedAt.Sub(ran))
	}
	if bound := ttl + 2*time.Second; ran.Sub(cutAt) > bound {
		t.Errorf("the other replica ran the slot %v into the partition, more than %v", ran.Sub(cutAt), bound)
	}
	rig.heal()
	w.ack()
	commit := w.next("commit")
	if commit["fenced"] != true {
		t.Errorf("the zombie leader's CommitTx after the heal: %v, want refused (fence.ErrFenced)", commit["err"])
	}
	w.next("bye")
	pgtest.Eventually(t, 30*time.Second, "the other replica's run to commit", func() bool {
		var n int
		err := rig.admin.QueryRow(ctx, `SELECT count(*) FROM data.runs WHERE by = 'outside'`).Scan(&n)
		return err == nil && n > 0
	})
	rows, err := rig.admin.Query(ctx, `SELECT slot, by FROM data.runs ORDER BY slot`)
	if err != nil {
		t.Fatal(err)
	}
	type ranSlot struct {
		Slot time.Time
		By   string
	}
	all, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ranSlot])
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || !all[0].Slot.Equal(slot) || all[0].By != "outside" {
		t.Errorf("runs recorded: %v; want the interrupted slot %v once, by the other replica", all, slot)
	}
}

// TestPartitionedManyLeases holds 2,000 leases on one client (TTL 4 s:
// renewals every 1.33 s, trust 3.6 s) through three black-holed partitions
// of 1.2 s: a renewal sent just before a cut gets through with TCP's
// retransmission 1.4 s after it was sent, well inside what the trust
// window leaves. None may be lost, and a prober outside the partition must
// not be granted any of them meanwhile.
func TestPartitionedManyLeases(t *testing.T) {
	rig := newPartitionRig(t)
	const n, ttl, cut = 2000, 4 * time.Second, 1200 * time.Millisecond
	prober := rig.client(ttl)
	w := rig.start("many", fmt.Sprintf("PART_COUNT=%d", n), "PART_TTL="+ttl.String())
	w.next("held")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	granted, probes := 0, 0
	for range 3 {
		rig.cut(netns.DropBoth)
		end := time.Now().Add(cut)
		for i := 0; time.Now().Before(end); i += 97 {
			probes++
			if l, err := prober.TryAcquire(ctx, fmt.Sprintf("many-%d", i%n)); err == nil {
				granted++
				_ = l.Release(ctx)
			}
		}
		rig.heal()
		// The next partition comes once the renewals have caught up.
		if _, err := io.WriteString(w.in, "sync\n"); err != nil {
			t.Fatal(err)
		}
		w.next("synced")
	}
	w.ack()
	lost := w.next("lost")["lost"].(float64)
	w.next("bye")
	t.Logf("%d leases through three %v partitions: %v lost; %d probes, %d granted", n, cut, lost, probes, granted)
	if lost != 0 {
		t.Errorf("%v of %d leases were lost through partitions shorter than their trust window", lost, n)
	}
	if granted != 0 {
		t.Errorf("a prober was granted %d leases that their holder still held", granted)
	}
}
