package runner_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
)

// collected reads every instrument of a ManualReader.
type collected struct{ rm metricdata.ResourceMetrics }

func collect(t *testing.T, r *sdkmetric.ManualReader) collected {
	t.Helper()
	var c collected
	if err := r.Collect(context.Background(), &c.rm); err != nil {
		t.Fatal(err)
	}
	return c
}

// value sums the data points of the named instrument whose attributes
// include every one given (a sum's value, a gauge's, or a histogram's
// count), and reports whether any matched.
func (c collected) value(name string, attrs ...attribute.KeyValue) (float64, bool) {
	match := func(set attribute.Set) bool {
		for _, a := range attrs {
			if v, ok := set.Value(a.Key); !ok || v != a.Value {
				return false
			}
		}
		return true
	}
	var (
		total float64
		found bool
	)
	for _, sm := range c.rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					if match(p.Attributes) {
						total += float64(p.Value)
						found = true
					}
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					if match(p.Attributes) {
						total += float64(p.Value)
						found = true
					}
				}
			case metricdata.Gauge[float64]:
				for _, p := range d.DataPoints {
					if match(p.Attributes) {
						total += p.Value
						found = true
					}
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					if match(p.Attributes) {
						total += float64(p.Count)
						found = true
					}
				}
			}
		}
	}
	return total, found
}

// The instruments, read through the SDK after a scripted
// sequence: acquire, renew, a takeover, a stale refusal, a commit, release;
// then runner runs that succeed, fail, and are fenced.
func TestMetrics(t *testing.T) {
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	lockReader := sdkmetric.NewManualReader()
	lockMP := sdkmetric.NewMeterProvider(sdkmetric.WithReader(lockReader))
	defer lockMP.Shutdown(context.Background())
	var (
		mu     sync.Mutex
		events []lock.Event
	)
	cfg := lock.Config{Schema: db.Schema, TTL: 3 * time.Second, RenewInterval: time.Second, MeterProvider: lockMP, Logger: quiet,
		OnEvent: func(e lock.Event) { mu.Lock(); events = append(events, e); mu.Unlock() }}
	a, err := lock.New(db.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close(ctx)
	cfg.OnEvent = nil
	b, err := lock.New(db.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(ctx)

	la, err := a.TryAcquire(ctx, "metered")
	if err != nil {
		t.Fatal(err)
	}
	if held, _ := collect(t, lockReader).value("pgfence.lease.held"); held != 1 {
		t.Fatalf("pgfence.lease.held = %v with one lease held, want 1", held)
	}
	time.Sleep(1200 * time.Millisecond) // one renewal
	if _, err := b.TryAcquire(ctx, "metered"); !errors.Is(err, lock.ErrHeld) {
		t.Fatalf("TryAcquire of a held lease: %v", err)
	}
	mustExec(t, db, expiry.SQL(db.Schema), "metered")
	lb, err := b.TryAcquire(ctx, "metered") // the takeover
	if err != nil {
		t.Fatal(err)
	}
	select { // a's next renewal finds it taken over
	case <-la.Done():
	case <-ctx.Done():
		t.Fatal("the taken-over lease was never lost")
	}
	stale := la.Guard().RunTx(ctx, db.Pool, func(tx pgx.Tx) error { _, err := tx.Exec(ctx, "SELECT 1"); return err })
	if !errors.Is(stale, fence.ErrFenced) {
		t.Fatalf("stale guard: %v", stale)
	}
	if err := lb.RunTx(ctx, func(tx pgx.Tx) error { _, err := tx.Exec(ctx, "SELECT 1"); return err }); err != nil {
		t.Fatal(err)
	}
	// A refusal by the server carries its SQLSTATE as error.type.
	if err := lb.RunTx(ctx, func(tx pgx.Tx) error { _, err := tx.Exec(ctx, "SELECT 1/0"); return err }); err == nil {
		t.Fatal("a division by zero committed")
	}
	if err := lb.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// An acquisition that fails: its context has already ended.
	ended, cancelEnded := context.WithCancel(ctx)
	cancelEnded()
	if _, err := b.TryAcquire(ended, "metered"); err == nil {
		t.Fatal("TryAcquire with an ended context acquired")
	}

	got := collect(t, lockReader)
	for _, c := range []struct {
		name  string
		attrs []attribute.KeyValue
		want  float64 // exact, or a minimum when atLeast
		least bool
	}{
		{"pgfence.lease.acquisitions", []attribute.KeyValue{attribute.String("pgfence.outcome", "acquired")}, 2, false},
		{"pgfence.lease.acquisitions", []attribute.KeyValue{attribute.String("pgfence.outcome", "held")}, 1, false},
		{"pgfence.lease.acquisitions", []attribute.KeyValue{attribute.String("pgfence.outcome", "error"), attribute.String("error.type", "canceled")}, 1, false},
		{"pgfence.lease.losses", []attribute.KeyValue{attribute.String("pgfence.cause", "taken_over")}, 1, false},
		{"pgfence.lease.renewal.duration", nil, 1, true},
		{"pgfence.lease.time_left", nil, 1, true},
		{"pgfence.lease.held", nil, 0, false},
		{"pgfence.guard.transactions", []attribute.KeyValue{attribute.String("pgfence.outcome", "stale")}, 1, false},
		{"pgfence.guard.transactions", []attribute.KeyValue{attribute.String("pgfence.outcome", "committed")}, 1, false},
		{"pgfence.guard.transactions", []attribute.KeyValue{attribute.String("pgfence.outcome", "error"), attribute.String("error.type", "22012")}, 1, false},
	} {
		v, ok := got.value(c.name, c.attrs...)
		if !ok || (c.least && v < c.want) || (!c.least && v != c.want) {
			t.Errorf("%s%v = %v (recorded: %v), want %v", c.name, c.attrs, v, ok, c.want)
		}
	}
	if _, ok := got.value("pgfence.lease.clock_skew"); !ok {
		t.Error("pgfence.lease.clock_skew was not observed")
	}
	kinds := map[lock.EventKind]int{}
	mu.Lock()
	defer mu.Unlock()
	for _, e := range events {
		kinds[e.Kind]++
		if e.Kind == lock.Lost && (e.Cause != lock.CauseTakenOver || !errors.Is(e.Err, lock.ErrLeaseLost)) {
			t.Errorf("lost event: %+v, want cause taken_over", e)
		}
	}
	if kinds[lock.Acquired] != 1 || kinds[lock.Lost] != 1 {
		t.Errorf("events of the first client: %v, want one acquired and one lost", kinds)
	}

	// The runner: one job succeeds, one fails, one is fenced (its lease is
	// taken over in the middle of its run).
	runReader := sdkmetric.NewManualReader()
	runMP := sdkmetric.NewMeterProvider(sdkmetric.WithReader(runReader))
	defer runMP.Shutdown(context.Background())
	thief, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer thief.Close(ctx)
	jobs := []runner.Job{
		{Name: "ok", Schedule: "@every 200ms", Run: func(ctx context.Context, run *runner.Run) error {
			return run.CommitTx(ctx, func(pgx.Tx) error { return nil })
		}},
		{Name: "bad", Schedule: "@every 200ms", Run: func(context.Context, *runner.Run) error { return errors.New("boom") }},
		{Name: "zombie", Schedule: "@every 200ms", Run: func(ctx context.Context, run *runner.Run) error {
			name := run.Lease().Name()
			if _, err := lock.ForceRelease(ctx, thief.Pool(), thief.Config().Schema, name); err != nil {
				return err
			}
			stolen, err := thief.TryAcquire(ctx, name)
			if err != nil {
				return err
			}
			defer stolen.Release(context.Background())
			return run.CommitTx(ctx, func(pgx.Tx) error { return nil })
		}},
	}
	in := start(t, db.Pool, lock.Config{Schema: db.Schema, MeterProvider: runMP}, runner.Config{}, func(r *runner.Runner) error {
		for _, j := range jobs {
			if err := r.Register(j); err != nil {
				return err
			}
		}
		return nil
	})
	statusOf := func(job, status string) float64 {
		v, _ := collect(t, runReader).value("pgfence.runner.runs", attribute.String("pgfence.job", job), attribute.String("pgfence.outcome", status))
		return v
	}
	waitFor(t, 20*time.Second, "a run to succeed, one to fail and one to be fenced", func() bool {
		return statusOf("ok", "succeeded") >= 1 && statusOf("bad", "failed") >= 1 && statusOf("zombie", "fenced") >= 1
	})
	// The time of ok's last success, while this instance leads it; none
	// for bad, which never succeeded.
	last, ok := collect(t, runReader).value("pgfence.runner.job.last_success", attribute.String("pgfence.job", "ok"))
	if ago := time.Since(time.Unix(0, int64(last*1e9))); !ok || ago < 0 || ago > time.Minute {
		t.Errorf("pgfence.runner.job.last_success of ok: %v (%v ago), %v; want within the last minute", last, ago, ok)
	}
	if v, _ := collect(t, runReader).value("pgfence.runner.job.last_success", attribute.String("pgfence.job", "bad")); v != 0 {
		t.Error("pgfence.runner.job.last_success observed for a job that never succeeded")
	}
	in.stop(t)
	got = collect(t, runReader)
	if v, _ := got.value("pgfence.runner.runs", attribute.String("pgfence.job", "bad"), attribute.String("pgfence.outcome", "failed"),
		attribute.String("error.type", "_OTHER")); v < 1 {
		t.Error("the failed runs of job bad carry no error.type _OTHER")
	}
	if v, _ := got.value("pgfence.runner.run.duration", attribute.String("pgfence.job", "ok")); v < 1 {
		t.Error("no run duration recorded for job ok")
	}
	if v, _ := got.value("pgfence.runner.leadership.changes", attribute.String("pgfence.change", "gained")); v < 3 {
		t.Errorf("leadership gained %v times, want at least once per job", v)
	}
	followsConventions(t, collect(t, lockReader), got)
}

// followsConventions checks the instruments recorded against the semantic
// conventions' naming rules and the project's one key per concept: no
// instrument's name is the namespace of another's (pgfence.x and
// pgfence.x.y), and every attribute key is one of a fixed few.
func followsConventions(t *testing.T, cs ...collected) {
	t.Helper()
	keys := map[attribute.Key]bool{"pgfence.outcome": true, "pgfence.cause": true, "pgfence.change": true,
		"pgfence.job": true, "pgfence.group": true, "pgfence.partition": true, "error.type": true}
	var names []string
	for _, c := range cs {
		for _, sm := range c.rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				names = append(names, m.Name)
				var sets []attribute.Set
				switch d := m.Data.(type) {
				case metricdata.Sum[int64]:
					for _, p := range d.DataPoints {
						sets = append(sets, p.Attributes)
					}
				case metricdata.Gauge[int64]:
					for _, p := range d.DataPoints {
						sets = append(sets, p.Attributes)
					}
				case metricdata.Histogram[float64]:
					for _, p := range d.DataPoints {
						sets = append(sets, p.Attributes)
					}
				}
				for _, set := range sets {
					for _, kv := range set.ToSlice() {
						if !keys[kv.Key] {
							t.Errorf("%s has attribute %s, not one of the project's keys", m.Name, kv.Key)
						}
					}
				}
			}
		}
	}
	if len(names) < 10 {
		t.Fatalf("only %d instruments recorded: %v", len(names), names)
	}
}

// No instrument's name is the namespace of another's (pgfence.x and
// pgfence.x.y: the semantic conventions forbid it), among every instrument
// a lock client and a runner create, recorded or not.
func TestInstrumentNames(t *testing.T) {
	db := pgtest.New(t)
	mp := &namingProvider{MeterProvider: sdkmetric.NewMeterProvider()}
	c, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, MeterProvider: mp})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	if _, err := runner.New(c, runner.Config{}); err != nil {
		t.Fatal(err)
	}
	names := mp.names
	for _, want := range []string{"pgfence.lease.acquisitions", "pgfence.guard.transactions", "pgfence.runner.runs"} {
		if !slices.Contains(names, want) {
			t.Fatalf("instruments created: %v, want %s among them", names, want)
		}
	}
	for _, a := range names {
		for _, b := range names {
			if strings.HasPrefix(b, a+".") {
				t.Errorf("instrument %s is the namespace of instrument %s", a, b)
			}
		}
	}
}

// namingProvider keeps the name of every instrument created through it,
// of every kind.
type namingProvider struct {
	metric.MeterProvider
	mu    sync.Mutex
	names []string
}

func (p *namingProvider) Meter(name string, opts ...metric.MeterOption) metric.Meter {
	return namingMeter{Meter: p.MeterProvider.Meter(name, opts...), p: p}
}

func (p *namingProvider) add(name string) {
	p.mu.Lock()
	p.names = append(p.names, name)
	p.mu.Unlock()
}

type namingMeter struct {
	metric.Meter
	p *namingProvider
}

func (m namingMeter) Int64Counter(name string, opts ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	m.p.add(name)
	return m.Meter.Int64Counter(name, opts...)
}

func (m namingMeter) Float64Histogram(name string, opts ...metric.Float64HistogramOption) (metric.Float64Histogram, error) {
	m.p.add(name)
	return m.Meter.Float64Histogram(name, opts...)
}

func (m namingMeter) Int64ObservableCounter(name string, opts ...metric.Int64ObservableCounterOption) (metric.Int64ObservableCounter, error) {
	m.p.add(name)
	return m.Meter.Int64ObservableCounter(name, opts...)
}

func (m namingMeter) Int64ObservableUpDownCounter(name string, opts ...metric.Int64ObservableUpDownCounterOption) (metric.Int64ObservableUpDownCounter, error) {
	m.p.add(name)
	return m.Meter.Int64ObservableUpDownCounter(name, opts...)
}

func (m namingMeter) Int64ObservableGauge(name string, opts ...metric.Int64ObservableGaugeOption) (metric.Int64ObservableGauge, error) {
	m.p.add(name)
	return m.Meter.Int64ObservableGauge(name, opts...)
}

func (m namingMeter) Float64ObservableGauge(name string, opts ...metric.Float64ObservableGaugeOption) (metric.Float64ObservableGauge, error) {
	m.p.add(name)
	return m.Meter.Float64ObservableGauge(name, opts...)
}
func (m namingMeter) Int64UpDownCounter(name string, opts ...metric.Int64UpDownCounterOption) (metric.Int64UpDownCounter, error) {
	m.p.add(name)
	return m.Meter.Int64UpDownCounter(name, opts...)
}

func (m namingMeter) Int64Histogram(name string, opts ...metric.Int64HistogramOption) (metric.Int64Histogram, error) {
	m.p.add(name)
	return m.Meter.Int64Histogram(name, opts...)
}

func (m namingMeter) Int64Gauge(name string, opts ...metric.Int64GaugeOption) (metric.Int64Gauge, error) {
	m.p.add(name)
	return m.Meter.Int64Gauge(name, opts...)
}

func (m namingMeter) Float64Counter(name string, opts ...metric.Float64CounterOption) (metric.Float64Counter, error) {
	m.p.add(name)
	return m.Meter.Float64Counter(name, opts...)
}

func (m namingMeter) Float64UpDownCounter(name string, opts ...metric.Float64UpDownCounterOption) (metric.Float64UpDownCounter, error) {
	m.p.add(name)
	return m.Meter.Float64UpDownCounter(name, opts...)
}

func (m namingMeter) Float64Gauge(name string, opts ...metric.Float64GaugeOption) (metric.Float64Gauge, error) {
	m.p.add(name)
	return m.Meter.Float64Gauge(name, opts...)
}

func (m namingMeter) Float64ObservableCounter(name string, opts ...metric.Float64ObservableCounterOption) (metric.Float64ObservableCounter, error) {
	m.p.add(name)
	return m.Meter.Float64ObservableCounter(name, opts...)
}

func (m namingMeter) Float64ObservableUpDownCounter(name string, opts ...metric.Float64ObservableUpDownCounterOption) (metric.Float64ObservableUpDownCounter, error) {
	m.p.add(name)
	return m.Meter.Float64ObservableUpDownCounter(name, opts...)
}

// pgfence.runner.leader is 1 on the instance that leads a job and 0 on the
// others, and moves with the leadership.
func TestLeaderGauge(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	job := runner.Job{Name: "solo", Schedule: "@every 1h", Run: func(context.Context, *runner.Run) error { return nil }}
	readers := map[string]*sdkmetric.ManualReader{}
	ins := map[string]*instance{}
	for _, who := range []string{"a", "b"} {
		readers[who] = sdkmetric.NewManualReader()
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(readers[who]))
		t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
		ins[who] = start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: who, TTL: 2 * time.Second, PollInterval: 50 * time.Millisecond, MeterProvider: mp},
			runner.Config{}, func(r *runner.Runner) error { return r.Register(job) })
	}
	leads := func(who string) float64 {
		v, ok := collect(t, readers[who]).value("pgfence.runner.leader", attribute.String("pgfence.job", "solo"))
		if !ok {
			return -1
		}
		return v
	}
	var leader, other string
	waitFor(t, 10*time.Second, "one instance to lead and the other to report 0", func() bool {
		a, b := leads("a"), leads("b")
		switch {
		case a == 1 && b == 0:
			leader, other = "a", "b"
		case a == 0 && b == 1:
			leader, other = "b", "a"
		default:
			return false
		}
		return true
	})
	ins[leader].stop(t)
	waitFor(t, 10*time.Second, "the other instance to report that it leads", func() bool { return leads(other) == 1 })
}

// A consumer group's metrics: the leader gauge per partition (1 for each
// partition this instance leads, 0 for the others) and the offsets committed.
func TestGroupMetrics(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	lead := func(ctx context.Context, p *runner.Partition) error {
		if p.Offset() < 2 {
			for range 2 {
				if err := p.Commit(ctx, func(context.Context, pgx.Tx) (int64, error) { return p.Offset() + 1, nil }); err != nil {
					return err
				}
			}
		}
		return p.Wait(ctx)
	}
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a", MeterProvider: mp}, runner.Config{},
		func(r *runner.Runner) error {
			return r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 3, Consume: lead})
		})
	role := attribute.String("pgfence.group", "relay")
	waitFor(t, 30*time.Second, "6 offsets committed and 3 partitions led", func() bool {
		c := collect(t, reader)
		commits, _ := c.value("pgfence.runner.offsets.committed", role)
		led, _ := c.value("pgfence.runner.partition.leader", role)
		return commits == 6 && led == 3
	})
	for p := range 3 {
		if v, ok := collect(t, reader).value("pgfence.runner.partition.leader", role, attribute.Int("pgfence.partition", p)); !ok || v != 1 {
			t.Fatalf("partition %d leader gauge: %v %v, want 1", p, v, ok)
		}
	}
}

// Slots a leader passes over (it woke late: frozen, or its run overran)
// count as missed only if no replica ran them, by the ledger. On a fake
// clock: the leader waits for 10:01; meanwhile another replica ran 10:01
// and 10:02 (rows in the ledger, as after a takeover while this one was
// frozen); at 10:03 the leader wakes and passes over both: 0 missed. The
// control, with nothing in the ledger: 2 missed.
func TestMissedSlotsOnlyWhenNoReplicaRanThem(t *testing.T) {
	t.Parallel()
	for _, ranElsewhere := range []bool{true, false} {
		name := map[bool]string{true: "ran elsewhere", false: "ran nowhere"}[ranElsewhere]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			reader := sdkmetric.NewManualReader()
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
			t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
			ev := &events{}
			began := time.Date(2026, 12, 1, 10, 0, 0, 1e6, time.UTC)
			clk := clock.NewFake(began)
			start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a", MeterProvider: mp}, runner.Config{OnEvent: ev.hook("a")},
				func(r *runner.Runner) error {
					r.SetClock(clk)
					return r.Register(runner.Job{Name: "tick", Schedule: "@every 1m", Run: func(context.Context, *runner.Run) error { return nil }})
				})
			waitFor(t, 10*time.Second, "the leader to wait for 10:01", func() bool { return clk.Pending() == 1 })
			if ranElsewhere {
				mustExec(t, db, "INSERT INTO "+tbl(db, "pgfence_runs")+` (job, shard, kind, slot, attempt, token, status, holder, started_at, finished_at)
					SELECT 'tick', 0, 'scheduled', s, 1, 1, 'succeeded', 'b', s, s FROM unnest($1::timestamptz[]) s`,
					[]time.Time{began.Truncate(time.Minute).Add(time.Minute), began.Truncate(time.Minute).Add(2 * time.Minute)})
			}
			// Woken late, as a frozen replica is: the clock is at 10:03
			// when its 10:01 timer fires.
			clk.Jump(3 * time.Minute)
			waitFor(t, 10*time.Second, "the 10:03 slot to run", func() bool { return len(ev.slots(runner.RunSucceeded)) == 1 })
			missed, _ := collect(t, reader).value("pgfence.runner.missed_slots")
			want := map[bool]float64{true: 0, false: 2}[ranElsewhere]
			if missed != want {
				t.Errorf("%s: pgfence.runner.missed_slots = %v, want %v", name, missed, want)
			}
		})
	}
}

// A group's lag and leaderless partitions are in sight. End says 10 for
// every partition and the leader commits up to 3: lag 7, in the metric
// (for the partitions this instance leads) and in Partitions. A member that
// registers the group and never takes its partitions (a replica stuck, as
// an instance row that heartbeats nothing) leaves its share without a
// leader: pgfence.runner.partitions.leaderless counts them.
func TestGroupLagAndLeaderlessPartitions(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	const poll = 50 * time.Millisecond
	lead := func(ctx context.Context, p *runner.Partition) error {
		for p.Offset() < 3 {
			if err := p.Commit(ctx, func(context.Context, pgx.Tx) (int64, error) { return p.Offset() + 1, nil }); err != nil {
				return err
			}
		}
		return p.Wait(ctx)
	}
	end := func(context.Context, int) (int64, error) { return 10, nil }
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a", TTL: time.Second, PollInterval: poll, MeterProvider: mp},
		runner.Config{RebalanceInterval: 200 * time.Millisecond},
		func(r *runner.Runner) error {
			return r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 4, Poll: poll, Consume: lead, End: end})
		})
	role := attribute.String("pgfence.group", "relay")
	waitFor(t, 30*time.Second, "a lag of 7 on each of the 4 partitions, and none without a leader", func() bool {
		c := collect(t, reader)
		lag, _ := c.value("pgfence.runner.partition.lag", role)
		orphans, ok := c.value("pgfence.runner.partitions.leaderless", role)
		return lag == 4*7 && ok && orphans == 0
	})
	infos, err := runner.Partitions(ctx, db.Pool, db.Schema, "relay")
	if err != nil || len(infos) != 4 {
		t.Fatalf("Partitions: %v, %v", infos, err)
	}
	for _, p := range infos {
		if p.End != 10 || p.Lag != 7 || p.EndAt.IsZero() {
			t.Errorf("partition %d: end %d, lag %d, end at %v; want 10, 7, set", p.Partition, p.End, p.Lag, p.EndAt)
		}
	}

	// A member that takes nothing: its share of the partitions is led by
	// nobody, and the live instance's gauge says how many.
	mustExec(t, db, "INSERT INTO "+tbl(db, "pgfence_instances")+` (id, started_at, heartbeat_at, expires_at, jobs)
		VALUES ('stuck', now(), now(), now() + interval '1 hour', ARRAY['pgfence/group/relay'])`)
	var orphans, unled float64
	waitFor(t, 30*time.Second, "the partitions given to the stuck member to count as leaderless, as Partitions shows them", func() bool {
		orphans, _ = collect(t, reader).value("pgfence.runner.partitions.leaderless", role)
		infos, err := runner.Partitions(ctx, db.Pool, db.Schema, "relay")
		if err != nil {
			t.Fatal(err)
		}
		unled = 0
		for _, p := range infos {
			if !p.Leading {
				unled++
			}
		}
		return orphans > 0 && orphans == unled
	})
	// Each says since when nobody leads it: when a released it.
	infos, err = runner.Partitions(ctx, db.Pool, db.Schema, "relay")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range infos {
		switch {
		case p.Leading && !p.LeaderlessSince.IsZero():
			t.Errorf("partition %d is led, and leaderless since %v", p.Partition, p.LeaderlessSince)
		case !p.Leading && (p.LeaderlessSince.IsZero() || p.LeaderlessSince.After(p.Now) || p.Now.Sub(p.LeaderlessSince) > time.Minute):
			t.Errorf("partition %d is not led, leaderless since %v (now %v)", p.Partition, p.LeaderlessSince, p.Now)
		}
	}
	// The lag series of the partitions that moved away have ended.
	if lag, _ := collect(t, reader).value("pgfence.runner.partition.lag", role); lag != (4-unled)*7 {
		t.Errorf("pgfence.runner.partition.lag sums %v over the partitions still led, want %v", lag, (4-unled)*7)
	}
}

// A partition whose Consume fails every time shows its consecutive failures in
// pgfence.runner.partition.failures, and Partition.Failures counts them
// for Consume itself.
func TestPartitionFailuresMetric(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	var seen atomic.Int64 // the Failures Consume saw at its last call
	start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a", PollInterval: 10 * time.Millisecond, MeterProvider: mp}, runner.Config{},
		func(r *runner.Runner) error {
			return r.RegisterConsumer(runner.Consumer{Group: "poisoned", Partitions: 1, Consume: func(ctx context.Context, p *runner.Partition) error {
				seen.Store(int64(p.Failures()))
				return errors.New("the item cannot be processed")
			}})
		})
	attrs := []attribute.KeyValue{attribute.String("pgfence.group", "poisoned"), attribute.Int("pgfence.partition", 0)}
	waitFor(t, 30*time.Second, "3 consecutive failures in the metric", func() bool {
		v, _ := collect(t, reader).value("pgfence.runner.partition.failures", attrs...)
		return v >= 3
	})
	if seen.Load() < 2 {
		t.Errorf("Consume saw Failures() = %d at its third call or later, want at least 2", seen.Load())
	}
}

// A job that fails every slot logs ERROR at its 1st, 2nd, 4th and 8th
// failure in a row, with the count (DEBUG in between), and a term's end is
// counted with its cause (here a shutdown).
func TestFailingJobLogPaceAndTermCause(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	logs := pgtest.NewLogs()
	logs.LogOnFailure(t)
	in := start(t, db.Pool, lock.Config{Schema: db.Schema, Holder: "a", MeterProvider: mp, Logger: slog.New(logs)}, runner.Config{},
		func(r *runner.Runner) error {
			return r.Register(runner.Job{Name: "flaky", Schedule: "@every 100ms",
				Run: func(context.Context, *runner.Run) error { return errors.New("the provider is down") }})
		})
	failures := func(level slog.Level) []int64 {
		var n []int64
		for _, r := range logs.Find(level, "run failed") {
			r.Attrs(func(a slog.Attr) bool {
				if a.Key == "consecutive_failures" {
					n = append(n, a.Value.Int64())
				}
				return true
			})
		}
		return n
	}
	waitFor(t, 30*time.Second, "9 failures in a row", func() bool { return len(failures(slog.LevelError))+len(failures(slog.LevelDebug)) >= 9 })
	if got := failures(slog.LevelError)[:4]; !slices.Equal(got, []int64{1, 2, 4, 8}) {
		t.Errorf("ERROR lines at failures %v, want 1, 2, 4, 8 (DEBUG in between)", got)
	}
	in.stop(t)
	if v, _ := collect(t, reader).value("pgfence.runner.leadership.changes", attribute.String("pgfence.job", "flaky"),
		attribute.String("pgfence.change", "lost"), attribute.String("pgfence.cause", "shutdown")); v != 1 {
		t.Errorf("leadership changes lost by shutdown: %v, want 1", v)
	}
}

// The runner's counters exist at 0 from Run's start, before anything
// happened: an alert on their increase then catches the first event.
func TestRunnerCountersStartAtZero(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	start(t, db.Pool, lock.Config{Schema: db.Schema, MeterProvider: mp}, runner.Config{}, func(r *runner.Runner) error {
		if err := r.Register(runner.Job{Name: "hourly", Schedule: "@every 1h", Run: func(context.Context, *runner.Run) error { return nil }}); err != nil {
			return err
		}
		return r.RegisterConsumer(runner.Consumer{Group: "relay", Partitions: 1,
			Consume: func(ctx context.Context, p *runner.Partition) error { return p.Wait(ctx) }})
	})
	job, group := attribute.String("pgfence.job", "hourly"), attribute.String("pgfence.group", "relay")
	waitFor(t, 30*time.Second, "the counters at 0", func() bool {
		c := collect(t, reader)
		for _, want := range []struct {
			name  string
			attrs []attribute.KeyValue
		}{
			{"pgfence.runner.runs", []attribute.KeyValue{job, attribute.String("pgfence.outcome", "failed"), attribute.String("error.type", "_OTHER")}},
			{"pgfence.runner.leadership.changes", []attribute.KeyValue{job, attribute.String("pgfence.change", "lost"), attribute.String("pgfence.cause", "lease_lost")}},
			{"pgfence.runner.leadership.changes", []attribute.KeyValue{group, attribute.String("pgfence.change", "lost"), attribute.String("pgfence.cause", "moved")}},
			{"pgfence.runner.runs", []attribute.KeyValue{job, attribute.String("pgfence.outcome", "fenced")}},
			{"pgfence.runner.missed_slots", []attribute.KeyValue{job}},
			{"pgfence.runner.retries", []attribute.KeyValue{job}},
			{"pgfence.runner.offsets.committed", []attribute.KeyValue{group}},
			{"pgfence.runner.heartbeat.failures", nil},
		} {
			if v, ok := c.value(want.name, want.attrs...); !ok || v != 0 {
				return false
			}
		}
		return true
	})
}
