// Command outbox is an exactly-once outbox relay on pgfence, runnable.
//
// An orders service writes each order's events to an outbox table in its
// own transactions (partition = hash of the order id, 8 partitions). Relay
// replicas, separate processes, drain the partitions into a sink table: one
// leader per partition (runner.RegisterConsumer), each batch delivered and the
// partition's offset committed in one guarded transaction
// (Partition.Commit). Meanwhile the orchestrator freezes a relay in the
// middle of a batch for longer than its lease (SIGSTOP), kills another
// (SIGKILL) and restarts it, and adds a fourth relay and removes it. Every
// event must arrive exactly once, and in order per order.
//
//	go run ./examples/outbox            # fenced: duplicates: 0, out of order: 0
//	go run ./examples/outbox -unfenced  # the same relay without the fence
//
// The database: DATABASE_URL, else a throwaway private PostgreSQL server
// that it starts and removes at exit.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/examples/internal/exampledb"
	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
)

const (
	partitions = 8
	group      = "outbox-relay"
	urlEnv     = "PGFENCE_DEMO_URL" // the resolved database, for the relays
)

func main() {
	var (
		unfenced = flag.Bool("unfenced", false, "deliver without the fence, to see the duplicates")
		schema   = flag.String("schema", "pgfence_outbox_demo", "schema for the demo's tables (dropped and recreated)")
		ttl      = flag.Duration("ttl", 2*time.Second, "the relays' lease TTL")
		orders   = flag.Int("orders", 40, "orders the service writes")
		events   = flag.Int("events", 25, "events per order")
		relayID  = flag.String("relay", "", "internal: run as the relay with this id")
	)
	flag.Parse()
	var err error
	if *relayID != "" {
		err = runRelay(*relayID, *schema, *ttl, *unfenced)
	} else {
		err = orchestrate(*schema, *ttl, *orders, *events, *unfenced)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox:", err)
		os.Exit(1)
	}
}

// partitionOf is the partition of an order: a hash of its id.
func partitionOf(order string) int {
	h := fnv.New32a()
	h.Write([]byte(order))
	return int(h.Sum32() % partitions)
}

// The relay's read: the events of partition $1 written by transactions
// from offset $2 on (a transaction id: the next to read) and before every
// transaction still
// open (pg_snapshot_xmin), by transaction then id, whole transactions at a
// time. Ordering by id alone would lose events: an id is taken when the row
// is written, and a transaction that took a lower id may commit after one
// that took a higher id, so an offset past the higher one would skip the
// lower for good. Transaction ids below the snapshot's xmin belong to
// transactions that have all ended, so none can appear later below the
// offset.
const readSQL = `WITH txs AS (
  SELECT DISTINCT txid FROM %[1]s.outbox
   WHERE partition = $1 AND txid >= $2 AND txid < pg_snapshot_xmin(pg_current_snapshot())::text::bigint
   ORDER BY txid LIMIT 20)
SELECT o.id, o.txid, o.order_id, o.seq FROM %[1]s.outbox o JOIN txs USING (txid)
 WHERE o.partition = $1 ORDER BY o.txid, o.id`

type event struct {
	id, txid int64
	order    string
	seq      int
}

// runRelay is one relay replica: it leads the partitions the runner gives
// it until SIGTERM.
func runRelay(id, schema string, ttl time.Duration, unfenced bool) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(context.Background(), os.Getenv(urlEnv))
	if err != nil {
		return err
	}
	defer pool.Close()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	c, err := lock.New(pool, lock.Config{Schema: schema, Holder: id, TTL: ttl, PollInterval: 200 * time.Millisecond, Logger: quiet})
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	r, err := runner.New(c, runner.Config{RebalanceInterval: ttl / 2})
	if err != nil {
		return err
	}
	q := pgx.Identifier{schema}.Sanitize()
	read := fmt.Sprintf(readSQL, q)
	deliver := "INSERT INTO " + q + ".deliveries (outbox_id, order_id, seq, relay, token) VALUES ($1, $2, $3, $4, $5)"
	say := func(format string, a ...any) { fmt.Printf("%s: %s\n", id, fmt.Sprintf(format, a...)) }
	// SIGUSR1 arms a freeze: the relay stops itself (SIGSTOP) right after
	// its next read, holding a batch it has not delivered yet, so that the
	// freeze falls at the worst moment however loaded the machine is.
	var freeze atomic.Bool
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	defer signal.Stop(usr1)
	go func() {
		for range usr1 {
			freeze.Store(true)
		}
	}()

	err = r.RegisterConsumer(runner.Consumer{
		Group:      group,
		Partitions: partitions,
		Poll:       500 * time.Millisecond,
		Consume: func(ctx context.Context, p *runner.Partition) error {
			say("leading partition %d with token %d from offset %d", p.Index, p.Token, p.Offset())
			offset := p.Offset()
			for ctx.Err() == nil {
				rows, err := pool.Query(ctx, read, p.Index, offset)
				if err != nil {
					return err
				}
				batch, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (event, error) {
					var e event
					return e, row.Scan(&e.id, &e.txid, &e.order, &e.seq)
				})
				if err != nil {
					return err
				}
				if len(batch) == 0 {
					if err := p.Wait(ctx); err != nil {
						return nil
					}
					continue
				}
				say("READ partition %d: %d events from offset %d", p.Index, len(batch), offset)
				if freeze.CompareAndSwap(true, false) {
					say("FROZEN holding partition %d's batch from offset %d", p.Index, offset)
					_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
				}
				time.Sleep(20 * time.Millisecond)    // the sink takes a while
				next := batch[len(batch)-1].txid + 1 // the offset after the batch
				write := func(ctx context.Context, tx pgx.Tx) error {
					for _, e := range batch {
						if _, err := tx.Exec(ctx, deliver, e.id, e.order, e.seq, id, int64(p.Token)); err != nil {
							return err
						}
					}
					return nil
				}
				if unfenced {
					// A relay without the fence: a plain transaction, which
					// a relay that was frozen past its lease still commits.
					err = pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
						if err := write(context.Background(), tx); err != nil {
							return err
						}
						_, err := tx.Exec(context.Background(), "UPDATE "+q+".pgfence_offsets SET committed_offset = $3 WHERE group_name = $1 AND partition = $2",
							group, p.Index, next)
						return err
					})
				} else {
					err = p.Commit(ctx, func(ctx context.Context, tx pgx.Tx) (int64, error) {
						return next, write(ctx, tx)
					})
				}
				var stale *fence.StaleTokenError
				switch {
				case errors.As(err, &stale):
					say("batch of partition %d REFUSED by the database: stale token %d (current %d)", p.Index, stale.Presented, stale.Current)
					return nil
				case errors.Is(err, fence.ErrFenced), err != nil && ctx.Err() != nil:
					// The lease ended (its trust window ran out during the
					// freeze): Commit sent nothing.
					say("batch of partition %d REFUSED before sending: %v", p.Index, err)
					return nil
				case err != nil:
					return err
				}
				offset = next
				say("delivered partition %d: %d events, offset %d", p.Index, len(batch), next)
			}
			return nil
		},
	})
	if err != nil {
		return err
	}
	say("started")
	return r.Run(ctx)
}

// relayProc is a running relay process.
type relayProc struct {
	id   string
	cmd  *exec.Cmd
	done chan struct{} // closed once its output is read to the end
}

func orchestrate(schema string, ttl time.Duration, orders, events int, unfenced bool) error {
	ctx := context.Background()
	db, err := exampledb.Open(ctx, os.Stdout)
	if err != nil {
		return err
	}
	defer db.Close()
	pool, where := db.Pool, db.Where
	mode := "fenced"
	if unfenced {
		mode = "UNFENCED"
	}
	fmt.Printf("pgfence outbox relay demo (%s), database: %s\n\n", mode, where)
	if err := setup(ctx, pool, schema); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}

	var (
		mu       sync.Mutex
		refused  int
		readers  = map[string]chan struct{}{} // relay id -> signalled when it has frozen itself
		readLine = regexp.MustCompile(`^(\S+): FROZEN holding partition (\d+)'s batch from offset (\d+)`)
		// The frozen relay's batch: its partition, and the offset it was
		// read from.
		frozenPart int
		frozenPos  int64
	)
	onLine := func(line string) {
		fmt.Println(line)
		mu.Lock()
		defer mu.Unlock()
		if strings.Contains(line, "REFUSED") {
			refused++
		}
		if m := readLine.FindStringSubmatch(line); m != nil {
			if ch, ok := readers[m[1]]; ok {
				frozenPart, _ = strconv.Atoi(m[2])
				frozenPos, _ = strconv.ParseInt(m[3], 10, 64)
				close(ch)
				delete(readers, m[1])
			}
		}
	}
	nextRead := func(id string) <-chan struct{} {
		mu.Lock()
		defer mu.Unlock()
		ch := make(chan struct{})
		readers[id] = ch
		return ch
	}
	start := func(id string) (*relayProc, error) {
		cmd := exec.Command(self, "-relay", id, "-schema", schema, "-ttl", ttl.String(), fmt.Sprintf("-unfenced=%v", unfenced))
		cmd.Env = append(os.Environ(), urlEnv+"="+pool.Config().ConnString())
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			return nil, err
		}
		p := &relayProc{id: id, cmd: cmd, done: make(chan struct{})}
		go func() {
			defer close(p.done)
			s := bufio.NewScanner(out)
			for s.Scan() {
				onLine(s.Text())
			}
		}()
		return p, nil
	}
	// Every line is read before Wait, which closes the pipe.
	wait := func(p *relayProc) {
		<-p.done
		_ = p.cmd.Wait()
	}
	say := func(format string, a ...any) { fmt.Printf("== %s\n", fmt.Sprintf(format, a...)) }

	// The orders service: each order's events in order, one transaction
	// each, waking the partition's relay in the same transaction.
	writeCtx, stopWriting := context.WithCancel(ctx)
	defer stopWriting()
	writerErr := make(chan error, 1)
	go func() { writerErr <- writeOrders(writeCtx, pool, schema, orders, events) }()

	watch := newLeaderWatch(pool, schema)
	watchCtx, stopWatch := context.WithCancel(ctx)
	watchDone := make(chan struct{})
	go func() { defer close(watchDone); watch.run(watchCtx) }()
	defer func() { stopWatch(); <-watchDone }()

	relays := map[string]*relayProc{}
	for _, id := range []string{"relay-1", "relay-2", "relay-3"} {
		p, err := start(id)
		if err != nil {
			return err
		}
		relays[id] = p
	}
	defer func() {
		for _, p := range relays {
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
			_ = p.cmd.Process.Kill()
		}
	}()
	if err := watch.until(30*time.Second, "every partition led", func(s leaderState) bool { return s.led() == partitions }); err != nil {
		return err
	}

	// 1. A relay frozen in the middle of a batch, for longer than its lease:
	// it stops itself (SIGSTOP) between reading a batch and delivering it.
	frozen := nextRead("relay-1")
	_ = relays["relay-1"].cmd.Process.Signal(syscall.SIGUSR1)
	select {
	case <-frozen:
	case <-time.After(60 * time.Second):
		return errors.New("relay-1 read no batch to freeze on")
	}
	say("relay-1 frozen (SIGSTOP) in the middle of a batch: a GC pause, a VM stall... longer than its %v lease", ttl)
	var handover []string // how long each event took until every partition was led again
	began := time.Now()
	took := func(what string) {
		handover = append(handover, fmt.Sprintf("%s %v", what, time.Since(began).Round(10*time.Millisecond)))
	}
	if err := watch.until(60*time.Second, "relay-1's partitions taken over", func(s leaderState) bool {
		return s.ledBy("relay-1") == 0 && s.led() == partitions
	}); err != nil {
		return err
	}
	took("freeze")
	// It resumes once the partition's new leader has delivered past where
	// the frozen batch was read: the frozen relay's delivery of that batch
	// now can only repeat it (unfenced), or be refused (fenced).
	mu.Lock()
	part, pos := frozenPart, frozenPos
	mu.Unlock()
	if err := watch.until(60*time.Second, "the frozen batch delivered by the partition's new leader", func(s leaderState) bool {
		for _, p := range s {
			if p.Partition == part && p.Offset > pos { // relay-1 is frozen: someone else
				return true
			}
		}
		return false
	}); err != nil {
		return err
	}
	_ = relays["relay-1"].cmd.Process.Signal(syscall.SIGCONT)
	say("relay-1 resumed (SIGCONT): it still holds its batch and its old token")

	// 2. A relay killed (kill -9) and restarted.
	began = time.Now()
	_ = relays["relay-2"].cmd.Process.Kill()
	wait(relays["relay-2"])
	delete(relays, "relay-2")
	say("relay-2 killed (SIGKILL)")
	if err := watch.until(60*time.Second, "relay-2's partitions taken over", func(s leaderState) bool {
		return s.ledBy("relay-2") == 0 && s.led() == partitions
	}); err != nil {
		return err
	}
	took("kill -9")
	p, err := start("relay-2b")
	if err != nil {
		return err
	}
	relays["relay-2b"] = p
	say("relay-2 restarted as relay-2b")

	// 3. A fourth relay joins, then leaves gracefully.
	began = time.Now()
	p, err = start("relay-4")
	if err != nil {
		return err
	}
	relays["relay-4"] = p
	say("relay-4 added")
	if err := watch.until(60*time.Second, "relay-4 leading", func(s leaderState) bool {
		return s.ledBy("relay-4") > 0 && s.led() == partitions
	}); err != nil {
		return err
	}
	took("join (process start included)")
	began = time.Now()
	_ = relays["relay-4"].cmd.Process.Signal(syscall.SIGTERM)
	if err := watch.until(60*time.Second, "relay-4's partitions handed over", func(s leaderState) bool {
		return s.ledBy("relay-4") == 0 && s.led() == partitions
	}); err != nil {
		return err
	}
	took("leave")
	wait(relays["relay-4"])
	delete(relays, "relay-4")
	say("relay-4 removed (SIGTERM)")

	// Drain: every event written is delivered (or, unfenced, at least once).
	if err := <-writerErr; err != nil {
		return err
	}
	say("the orders service has written %d events", orders*events)
	total := orders * events
	deadline := time.Now().Add(90 * time.Second)
	for {
		var distinct int
		if err := pool.QueryRow(ctx, "SELECT count(DISTINCT outbox_id) FROM "+pgx.Identifier{schema}.Sanitize()+".deliveries").Scan(&distinct); err != nil {
			return err
		}
		if distinct >= total {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d events delivered after 90 s", distinct, total)
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, p := range relays {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	for id, p := range relays {
		wait(p)
		delete(relays, id)
	}
	mu.Lock()
	r := refused
	mu.Unlock()
	return report(ctx, pool, schema, total, r, watch, handover)
}

// writeOrders writes events for orders: each order's events one after the
// other, each in its own transaction with the partition's wake-up.
func writeOrders(ctx context.Context, pool *pgxpool.Pool, schema string, orders, events int) error {
	q := pgx.Identifier{schema}.Sanitize()
	insert := "INSERT INTO " + q + ".outbox (order_id, seq, partition) VALUES ($1, $2, $3)"
	var wg sync.WaitGroup
	errs := make(chan error, orders)
	for o := range orders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			order := fmt.Sprintf("order-%03d", o)
			part := partitionOf(order)
			for seq := 1; seq <= events; seq++ {
				time.Sleep(time.Duration(100+rand.IntN(200)) * time.Millisecond)
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, insert, order, seq, part); err != nil {
						return err
					}
					return runner.Wake(ctx, tx, schema, group, part)
				})
				if err != nil {
					errs <- fmt.Errorf("order %s event %d: %w", order, seq, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// leaderState is the partitions' leaders seen by one read.
type leaderState []runner.PartitionInfo

func (s leaderState) led() int {
	n := 0
	for _, p := range s {
		if p.Leading {
			n++
		}
	}
	return n
}

func (s leaderState) ledBy(id string) int {
	n := 0
	for _, p := range s {
		if p.Leading && p.Leader == id {
			n++
		}
	}
	return n
}

// leaderWatch reads the partitions every 50 ms: leadership changes, and
// the time each partition spends without a leader.
type leaderWatch struct {
	pool   *pgxpool.Pool
	schema string

	mu         sync.Mutex
	state      leaderState
	handovers  int
	leaderless map[int]time.Duration
	longest    time.Duration
	since      map[int]time.Time // when a partition lost its leader
	tokens     map[int]fence.Token
	changed    chan struct{}
}

func newLeaderWatch(pool *pgxpool.Pool, schema string) *leaderWatch {
	return &leaderWatch{pool: pool, schema: schema, leaderless: map[int]time.Duration{}, since: map[int]time.Time{},
		tokens: map[int]fence.Token{}, changed: make(chan struct{}, 1)}
}

func (w *leaderWatch) run(ctx context.Context) {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		if infos, err := runner.Partitions(ctx, w.pool, w.schema, group); err == nil {
			w.observe(infos, time.Now())
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (w *leaderWatch) observe(infos []runner.PartitionInfo, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.state = infos
	for _, p := range infos {
		if old, ok := w.tokens[p.Partition]; ok && p.Leading && p.LeaderToken != old && old != 0 {
			w.handovers++
		}
		if p.Leading {
			w.tokens[p.Partition] = p.LeaderToken
			if at, ok := w.since[p.Partition]; ok {
				gap := now.Sub(at)
				w.leaderless[p.Partition] += gap
				w.longest = max(w.longest, gap)
				delete(w.since, p.Partition)
			} else if _, ok := w.leaderless[p.Partition]; !ok {
				w.leaderless[p.Partition] = 0
			}
		} else if _, led := w.tokens[p.Partition]; led {
			// Counted from the first time it had a leader: start-up is not
			// a gap.
			if _, ok := w.since[p.Partition]; !ok {
				w.since[p.Partition] = now
			}
		}
	}
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

// until waits for cond on the partitions' state.
func (w *leaderWatch) until(d time.Duration, what string, cond func(leaderState) bool) error {
	deadline := time.After(d)
	for {
		w.mu.Lock()
		ok := cond(w.state)
		w.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-w.changed:
		case <-deadline:
			return fmt.Errorf("timed out after %v waiting for %s", d, what)
		}
	}
}

func setup(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	q := pgx.Identifier{schema}.Sanitize()
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+q+" CASCADE"); err != nil {
		return err
	}
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		return err
	}
	for _, stmt := range []string{
		// The orders service's outbox: txid is the writing transaction's
		// id, which the relay orders by (readSQL says why).
		"CREATE TABLE " + q + `.outbox (id bigserial PRIMARY KEY, order_id text NOT NULL, seq int NOT NULL,
			partition int NOT NULL, txid bigint NOT NULL DEFAULT pg_current_xact_id()::text::bigint)`,
		"CREATE INDEX ON " + q + ".outbox (partition, txid)",
		// The sink: every delivery, duplicates included, in arrival order.
		"CREATE TABLE " + q + `.deliveries (n bigserial PRIMARY KEY, outbox_id bigint NOT NULL, order_id text NOT NULL,
			seq int NOT NULL, relay text NOT NULL, token bigint NOT NULL)`,
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			return err
		}
	}
	return nil
}

func report(ctx context.Context, pool *pgxpool.Pool, schema string, total, refused int, w *leaderWatch, handover []string) error {
	q := pgx.Identifier{schema}.Sanitize()
	var delivered, distinct, outOfOrder int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT outbox_id) FROM "+q+".deliveries").Scan(&delivered, &distinct); err != nil {
		return err
	}
	// Out of order: a delivery of an order's event after a later event of
	// the same order had been delivered.
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM (
  SELECT seq, max(seq) OVER (PARTITION BY order_id ORDER BY n ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS before
    FROM `+q+`.deliveries) d WHERE seq < before`).Scan(&outOfOrder); err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	parts := make([]int, 0, len(w.leaderless))
	for p := range w.leaderless {
		parts = append(parts, p)
	}
	sort.Ints(parts)
	var gaps []string
	for _, p := range parts {
		gaps = append(gaps, fmt.Sprintf("%d:%v", p, w.leaderless[p].Round(10*time.Millisecond)))
	}
	fmt.Printf("\nevents written: %d\ndelivered: %d\ndistinct: %d\nduplicates: %d\nout of order: %d\n",
		total, delivered, distinct, delivered-distinct, outOfOrder)
	fmt.Printf("stale batches refused: %d\nhandovers: %d\nlongest time without a leader: %v\ntime without a leader by partition: %s\n",
		refused, w.handovers, w.longest.Round(10*time.Millisecond), strings.Join(gaps, " "))
	fmt.Printf("every partition led again after: %s\n", strings.Join(handover, ", "))
	return nil
}
