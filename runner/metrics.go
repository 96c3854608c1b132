package runner

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/pgfence/pgfence/internal/buckets"
	"github.com/pgfence/pgfence/internal/errtype"
)

// metrics are a runner's instruments (README's "Metrics"). Attributes:
// pgfence.job (bounded: the jobs an application registers) or pgfence.group
// (its consumer groups) and, per instrument, pgfence.outcome or
// pgfence.change; never shards or slots. The exceptions are
// pgfence.runner.partition.leader, .lag and .failures, by pgfence.partition
// too, for the partitions this instance leads now only.
type metrics struct {
	runs, retries, leadership, missed, offsets metric.Int64Counter
	duration                                   metric.Float64Histogram
	owned, leader, partLeader, lag, leaderless metric.Int64ObservableGauge
	partFailures, jobFailures                  metric.Int64ObservableGauge
	lastSuccess                                metric.Float64ObservableGauge
	heartbeatFailures                          metric.Int64ObservableCounter
	beatsFailed                                atomic.Int64
	meter                                      metric.Meter

	mu      sync.Mutex
	shards  map[string]int64     // job -> shards this instance owns
	jobs    []string             // the registered jobs, for the leader gauge
	leading map[string]int       // job -> its leases (job or shards) this instance holds
	groups  map[string]int       // group -> its partition count, for the partition gauge
	led     map[partKey]bool     // the group partitions this instance leads
	lags    map[partKey]int64    // the lag of the partitions it leads, once their end offset is known
	fails   map[partKey]int64    // the consecutive Consume failures of the partitions it leads
	jobFail map[string]int64     // job -> its attempts failed in a row here (reset by a success)
	lastOK  map[string]time.Time // job -> its last success known here (the ledger's at a term's start, then this instance's)
	orphans map[string]int64     // group -> its partitions without a leader, at the last look
}

type partKey struct {
	group     string
	partition int
}

func newMetrics(mp metric.MeterProvider) (*metrics, error) {
	m := &metrics{meter: mp.Meter("github.com/pgfence/pgfence/runner"), shards: map[string]int64{}, leading: map[string]int{},
		groups: map[string]int{}, led: map[partKey]bool{}, lags: map[partKey]int64{}, fails: map[partKey]int64{}, jobFail: map[string]int64{}, orphans: map[string]int64{}, lastOK: map[string]time.Time{}}
	var err error
	keep := func(e error) {
		if err == nil {
			err = e
		}
	}
	var e error
	m.runs, e = m.meter.Int64Counter("pgfence.runner.runs", metric.WithUnit("{run}"),
		metric.WithDescription("Finished attempts, by pgfence.job and pgfence.outcome: succeeded, failed, fenced, skipped (the job was paused)."))
	keep(e)
	m.duration, e = m.meter.Float64Histogram("pgfence.runner.run.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of an attempt, by pgfence.job and pgfence.outcome."),
		metric.WithExplicitBucketBoundaries(buckets.Wait...))
	keep(e)
	m.retries, e = m.meter.Int64Counter("pgfence.runner.retries", metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts after the first at a slot, by pgfence.job."))
	keep(e)
	m.leadership, e = m.meter.Int64Counter("pgfence.runner.leadership.changes", metric.WithUnit("{change}"),
		metric.WithDescription("Job and shard leases taken and ended on this instance, by pgfence.job and pgfence.change: gained, lost (with pgfence.cause: released, moved, handed_over, shutdown, lease_lost, failed)."))
	keep(e)
	m.missed, e = m.meter.Int64Counter("pgfence.runner.missed_slots", metric.WithUnit("{slot}"),
		metric.WithDescription("Slots that passed without any replica running them (downtime, by Missed policy, or while a run overran), by pgfence.job."))
	keep(e)
	m.owned, e = m.meter.Int64ObservableGauge("pgfence.runner.shards.owned", metric.WithUnit("{shard}"),
		metric.WithDescription("Shards of a sharded job this instance is assigned, by pgfence.job."))
	keep(e)
	m.offsets, e = m.meter.Int64Counter("pgfence.runner.offsets.committed", metric.WithUnit("{commit}"),
		metric.WithDescription("Partition offsets committed (Partition.Commit), by pgfence.group."))
	keep(e)
	m.partLeader, e = m.meter.Int64ObservableGauge("pgfence.runner.partition.leader",
		metric.WithDescription("1 while this instance leads the consumer group's partition (no series otherwise), by pgfence.group and pgfence.partition."))
	keep(e)
	m.lag, e = m.meter.Int64ObservableGauge("pgfence.runner.partition.lag", metric.WithUnit("{offset}"),
		metric.WithDescription("End - Offset of a partition this instance leads (Consumer.End): the items not consumed yet, by pgfence.group and pgfence.partition."))
	keep(e)
	m.partFailures, e = m.meter.Int64ObservableGauge("pgfence.runner.partition.failures", metric.WithUnit("{failure}"),
		metric.WithDescription("Consecutive failures of Consume on a partition this instance leads (Partition.Failures), by pgfence.group and pgfence.partition."))
	keep(e)
	m.jobFailures, e = m.meter.Int64ObservableGauge("pgfence.runner.job.failures", metric.WithUnit("{attempt}"),
		metric.WithDescription("Attempts of the job that failed (or panicked) in a row while this instance leads it, 0 after a success, by pgfence.job."))
	keep(e)
	m.leaderless, e = m.meter.Int64ObservableGauge("pgfence.runner.partitions.leaderless", metric.WithUnit("{partition}"),
		metric.WithDescription("Partitions of the consumer group whose lease nobody holds, as this instance's balancer last saw them, by pgfence.group."))
	keep(e)
	m.lastSuccess, e = m.meter.Float64ObservableGauge("pgfence.runner.job.last_success", metric.WithUnit("s"),
		metric.WithDescription("Unix time of the job's last successful scheduled attempt, while this instance leads the job (from the ledger when its term starts), by pgfence.job."))
	keep(e)
	// Counted from the start, so that it is there (at 0) before the first
	// failure.
	m.heartbeatFailures, e = m.meter.Int64ObservableCounter("pgfence.runner.heartbeat.failures", metric.WithUnit("{heartbeat}"),
		metric.WithDescription("Heartbeats that failed: the instance's liveness row was not renewed (the database unreachable, refusing or too slow); its jobs' shares are kept meanwhile."))
	keep(e)
	m.leader, e = m.meter.Int64ObservableGauge("pgfence.runner.leader",
		metric.WithDescription("1 while this instance leads the job (holds its lease, or a shard's), else 0, by pgfence.job."))
	keep(e)
	if err != nil {
		return nil, fmt.Errorf("runner: metrics: %w", err)
	}
	return m, nil
}

// observe registers the gauges' callback for the time of Run, for jobs
// (and groups, with their partition counts).
func (m *metrics) observe(jobs []string, groups map[string]int) (metric.Registration, error) {
	m.mu.Lock()
	m.jobs, m.groups = jobs, groups
	m.mu.Unlock()
	// The counters' series exist from the start, at 0: an increase over a
	// series that appears at 1 misses that first event.
	ctx := context.Background()
	// A failure's series carries its error.type: a job's own errors are
	// _OTHER (a panic, a SQLSTATE: their series appear with them).
	changes := func(who attribute.KeyValue) {
		m.leadership.Add(ctx, 0, metric.WithAttributes(who, attribute.String("pgfence.change", "gained")))
		for _, cause := range []string{EndReleased, EndMoved, EndHandedOver, EndShutdown, EndLeaseLost, EndFailed} {
			m.leadership.Add(ctx, 0, metric.WithAttributes(who, attribute.String("pgfence.change", "lost"), attribute.String("pgfence.cause", cause)))
		}
	}
	for _, job := range jobs {
		j := attribute.String("pgfence.job", job)
		for _, outcome := range []string{"succeeded", "fenced", "skipped"} {
			m.runs.Add(ctx, 0, metric.WithAttributes(j, attribute.String("pgfence.outcome", outcome)))
		}
		m.runs.Add(ctx, 0, metric.WithAttributes(j, attribute.String("pgfence.outcome", "failed"), errtype.Key.String(errtype.Other)))
		m.missed.Add(ctx, 0, metric.WithAttributes(j))
		m.retries.Add(ctx, 0, metric.WithAttributes(j))
		changes(j)
	}
	for group := range groups {
		g := attribute.String("pgfence.group", group)
		m.offsets.Add(ctx, 0, metric.WithAttributes(g))
		changes(g)
	}
	return m.meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		m.mu.Lock()
		defer m.mu.Unlock()
		for job, n := range m.shards {
			o.ObserveInt64(m.owned, n, metric.WithAttributes(attribute.String("pgfence.job", job)))
		}
		for _, job := range m.jobs {
			var leads int64
			if m.leading[job] > 0 {
				leads = 1
			}
			o.ObserveInt64(m.leader, leads, metric.WithAttributes(attribute.String("pgfence.job", job)))
		}
		// Only the partitions this instance leads now: a group of many
		// partitions does not make as many series on every instance, and a
		// partition's series ends when it moves away.
		for k, leads := range m.led {
			if !leads {
				continue
			}
			attrs := metric.WithAttributes(attribute.String("pgfence.group", k.group), attribute.Int("pgfence.partition", k.partition))
			o.ObserveInt64(m.partLeader, 1, attrs)
			if lag, ok := m.lags[k]; ok {
				o.ObserveInt64(m.lag, lag, attrs)
			}
			o.ObserveInt64(m.partFailures, m.fails[k], attrs)
		}
		// A job's failures in a row, while this instance leads it: once
		// another leads it, that one's count is the one that matters.
		for _, job := range m.jobs {
			if m.leading[job] > 0 {
				attrs := metric.WithAttributes(attribute.String("pgfence.job", job))
				o.ObserveInt64(m.jobFailures, m.jobFail[job], attrs)
				if at, ok := m.lastOK[job]; ok {
					o.ObserveFloat64(m.lastSuccess, float64(at.UnixNano())/1e9, attrs)
				}
			}
		}
		for group, n := range m.orphans {
			o.ObserveInt64(m.leaderless, n, metric.WithAttributes(attribute.String("pgfence.group", group)))
		}
		o.ObserveInt64(m.heartbeatFailures, m.beatsFailed.Load())
		return nil
	}, m.owned, m.leader, m.partLeader, m.lag, m.leaderless, m.partFailures, m.jobFailures, m.lastSuccess, m.heartbeatFailures)
}

func (m *metrics) setShards(job string, n int64) {
	m.mu.Lock()
	m.shards[job] = n
	m.mu.Unlock()
}

// event records what a runner event says.
func (m *metrics) event(e Event, took time.Duration) {
	ctx := context.Background()
	m.mu.Lock()
	_, isGroup := m.groups[e.Job]
	m.mu.Unlock()
	job := attribute.String("pgfence.job", e.Job)
	if isGroup {
		job = attribute.String("pgfence.group", e.Job)
	}
	switch e.Kind {
	case LeadershipGained, LeadershipLost:
		change, delta := "gained", 1
		if e.Kind == LeadershipLost {
			change, delta = "lost", -1
		}
		m.mu.Lock()
		m.leading[e.Job] += delta
		if m.leading[e.Job] <= 0 {
			delete(m.jobFail, e.Job)
		}
		if isGroup {
			k := partKey{e.Job, e.Shard}
			if delta > 0 {
				m.led[k] = true
			} else {
				delete(m.led, k)
				delete(m.lags, k)
				delete(m.fails, k)
			}
		}
		m.mu.Unlock()
		attrs := []attribute.KeyValue{job, attribute.String("pgfence.change", change)}
		if e.Kind == LeadershipLost {
			attrs = append(attrs, attribute.String("pgfence.cause", termCause(e.Err)))
		}
		m.leadership.Add(ctx, 1, metric.WithAttributes(attrs...))
	case RunStarted:
		if e.Attempt > 1 {
			m.retries.Add(ctx, 1, metric.WithAttributes(job))
		}
	case RunSucceeded, RunFailed, RunFenced:
		m.mu.Lock()
		switch e.Kind {
		case RunSucceeded:
			m.jobFail[e.Job] = 0
			if !e.Manual {
				m.lastOK[e.Job] = time.Now()
			}
		case RunFailed:
			m.jobFail[e.Job]++
		}
		m.mu.Unlock()
		status := map[EventKind]string{RunSucceeded: "succeeded", RunFailed: "failed", RunFenced: "fenced"}[e.Kind]
		kv := []attribute.KeyValue{job, attribute.String("pgfence.outcome", status)}
		if e.Kind == RunFailed {
			kv = append(kv, runErrType(e.Err))
		}
		attrs := metric.WithAttributes(kv...)
		m.runs.Add(ctx, 1, attrs)
		m.duration.Record(ctx, took.Seconds(), attrs)
	}
}

func (m *metrics) skipped(job string) {
	m.runs.Add(context.Background(), 1, metric.WithAttributes(attribute.String("pgfence.job", job), attribute.String("pgfence.outcome", "skipped")))
}

func (m *metrics) missedSlots(job string, n int) {
	if n > 0 {
		m.missed.Add(context.Background(), int64(n), metric.WithAttributes(attribute.String("pgfence.job", job)))
	}
}

// setLag records the lag of a partition this instance leads.
func (m *metrics) setLag(group string, partition int, lag int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if k := (partKey{group, partition}); m.led[k] {
		m.lags[k] = lag
	}
}

// setFailures records the consecutive Consume failures of a partition this
// instance leads.
func (m *metrics) setFailures(group string, partition int, n int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if k := (partKey{group, partition}); m.led[k] {
		m.fails[k] = int64(n)
	}
}

// setLeaderless records how many partitions of each group the balancer saw
// without a leader (held: the holder of each partition, "" for none).
func (m *metrics) setLeaderless(jobs []*job, held map[string][]string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, j := range jobs {
		if j.group == nil {
			continue
		}
		var n int64
		for _, h := range held[j.Name] {
			if h == "" {
				n++
			}
		}
		m.orphans[j.Name] = n
	}
}

func (m *metrics) offsetCommitted(group string) {
	m.offsets.Add(context.Background(), 1, metric.WithAttributes(attribute.String("pgfence.group", group)))
}

// runErrType is a failed attempt's error.type: "panic" for a job that
// panicked, else the error's kind (errtype.Of).
func runErrType(err error) attribute.KeyValue {
	if _, ok := errors.AsType[*panicError](err); ok {
		return errtype.Key.String("panic")
	}
	return errtype.Attr(err)
}

// succeeded records a success of job at (read from the ledger), if later
// than the one known.
func (m *metrics) succeeded(job string, at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if at.After(m.lastOK[job]) {
		m.lastOK[job] = at
	}
}

func (m *metrics) heartbeatFailed() { m.beatsFailed.Add(1) }
