// Command bench compares pgfence with what its users would pick instead (a
// Redis lock, PostgreSQL advisory locks, plain durable commits as floors) in
// one run, the forms taking turns round by round so that a noisy machine
// hits them all alike, and prints a markdown table: median, min-max and the
// number of rounds per row. With -write it replaces the generated part of
// BENCHMARKS.md.
//
//	go run -C bench . -write ../BENCHMARKS.md
//
// It is a module of its own, so that its comparison-only dependencies
// (go-redis) never reach the library's go.mod, and `go test ./...` in the
// repository does not run it.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
)

const schema = "pgfence_bench"

func main() {
	dbURL := flag.String("database-url", firstNonEmpty(os.Getenv("DATABASE_URL"), os.Getenv("TEST_DATABASE_URL"),
		"postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (its schema "+schema+" is dropped and created)")
	redisAddr := flag.String("redis", "127.0.0.1:6379", "Redis address")
	rounds := flag.Int("rounds", 5, "rounds per table")
	cell := flag.Duration("cell", time.Second, "time per measurement")
	handovers := flag.Int("handovers", 200, "handovers per handover row")
	soakRuns := flag.Int("soak-runs", 20, "runs of each case of 10,000 leases in the soak section")
	soakRunsLarge := flag.Int("soak-runs-large", 20, "runs of each case of 100,000 leases in the soak section")
	write := flag.String("write", "", "BENCHMARKS.md to update between its generated-section markers")
	only := flag.String("sections", strings.Join(sectionNames, ","), "the sections to run, comma-separated; also "+
		strings.Join(longSections, ", ")+" (each a few minutes, written to a block of its own)")
	childName, childTTL := childFlags()
	etcdKey, etcdURL := etcdChildFlags()
	riverID := riverChildFlag()
	flag.Parse()
	ctx := context.Background()
	if *riverID != "" {
		if err := riverChild(ctx, *dbURL, *riverID); err != nil {
			fmt.Fprintln(os.Stderr, "bench: river child:", err)
			os.Exit(1)
		}
		return
	}
	if *etcdKey != "" {
		if err := etcdChild(ctx, *etcdURL, *etcdKey, *childTTL); err != nil {
			fmt.Fprintln(os.Stderr, "bench: etcd crash child:", err)
			os.Exit(1)
		}
		return
	}
	if *childName != "" {
		if err := crashChild(ctx, *dbURL, *childName, *childTTL); err != nil {
			fmt.Fprintln(os.Stderr, "bench: crash child:", err)
			os.Exit(1)
		}
		return
	}
	b, err := setup(ctx, *dbURL, *redisAddr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
	defer b.close()
	sections := map[string]func(*bytes.Buffer) error{
		"pairs":      func(out *bytes.Buffer) error { return b.pairs(ctx, out, *rounds, *cell) },
		"guarded":    func(out *bytes.Buffer) error { return b.guarded(ctx, out, *rounds, *cell) },
		"costs":      func(out *bytes.Buffer) error { return b.costs(ctx, out, 2**cell) },
		"parts":      func(out *bytes.Buffer) error { return b.parts(ctx, out, 2**rounds, *cell) },
		"handover":   func(out *bytes.Buffer) error { return b.handover(ctx, out, *handovers) },
		"crash":      func(out *bytes.Buffer) error { return b.crash(ctx, out, 5) },
		"scale":      func(out *bytes.Buffer) error { return b.scale(ctx, out, 3*time.Second, 5, 1, 100, 1000, 10000) },
		"singletons": func(out *bytes.Buffer) error { return b.singletons(ctx, out, 10*time.Second, 100) },
		"runner":     func(out *bytes.Buffer) error { return b.runnerRows(ctx, out) },
		"river":      func(out *bytes.Buffer) error { return b.river(ctx, out, 2, 10*time.Second) },
		// 100,000 leases on one client, at the default TTL and at 3 s (a
		// renewal every second: they are kept only if each lease's
		// renewal comes back well inside its trust window), 10 renewal
		// intervals each.
		"leases": func(out *bytes.Buffer) error { return b.manyLeases(ctx, out) },
		// The lease-loss reports' cases, run -soak-runs times each in a
		// row with two CPU hogs: 10,000 and 100,000 leases at a 3 s TTL,
		// 8 and 16 acquirers on pools of 8 and 16.
		"soak": func(out *bytes.Buffer) error { return b.soak(ctx, out, *soakRuns, *soakRunsLarge) },
		// Fleets at scale: 100, 1,000 and 10,000 singleton jobs on ten
		// replicas.
		"fleet": func(out *bytes.Buffer) error {
			for _, jobs := range []int{100, 1000, 10000} {
				if err := b.singletons(ctx, out, 10*time.Second, jobs); err != nil {
					return err
				}
			}
			return nil
		},
	}
	var out bytes.Buffer
	start := time.Now()
	fmt.Fprint(&out, b.header(ctx))
	for _, name := range strings.Split(*only, ",") {
		run, ok := sections[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "bench: no section %q (the sections: %s)\n", name, strings.Join(sectionNames, ","))
			os.Exit(2)
		}
		fmt.Fprintf(os.Stderr, "bench: %s (%s so far)\n", name, time.Since(start).Round(time.Second))
		if err := run(&out); err != nil {
			fmt.Fprintf(os.Stderr, "bench: %s: %v\n", name, err)
			os.Exit(1)
		}
	}
	fmt.Fprintf(&out, "\nThe whole run took %s.\n", time.Since(start).Round(time.Second))
	os.Stdout.Write(out.Bytes())
	if *write != "" {
		block := "bench"
		switch {
		case slices.Contains(longSections, *only):
			block = "bench:" + *only
		case *only != strings.Join(sectionNames, ","):
			fmt.Fprintln(os.Stderr, "bench: -write needs every section (or one of "+strings.Join(longSections, ", ")+
				" alone), so that each block of BENCHMARKS.md shows one run")
			os.Exit(2)
		}
		if err := splice(*write, block, out.Bytes()); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
	}
}

// sectionNames are the sections, in the order they run and print.
var sectionNames = []string{"pairs", "guarded", "costs", "parts", "handover", "crash", "scale", "runner"}

// longSections run only when named, and -write puts each in a block of
// its own (<!-- bench:NAME:begin --> ... <!-- bench:NAME:end -->).
// (singletons, 100 jobs, and leases, 100,000 leases on one client, also
// run alone, for development: fleet has them.)
var longSections = []string{"river", "fleet", "leases", "soak"}

type bench struct {
	url   string
	pool  *pgxpool.Pool
	sent  *counter // what pool has sent
	redis *redis.Client
	etcd  *etcdServer
}

func setup(ctx context.Context, dbURL, redisAddr string) (*bench, error) {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 40
	sent := &counter{}
	cfg.ConnConfig.Tracer = sent
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	b := &bench{url: dbURL, pool: pool, sent: sent, redis: redis.NewClient(&redis.Options{Addr: redisAddr, PoolSize: 16})}
	if err := b.redis.Ping(ctx).Err(); err != nil {
		b.close()
		return nil, fmt.Errorf("redis at %s: %w (start it as ../shared/README.md says)", redisAddr, err)
	}
	if b.etcd, err = startEtcd(ctx); err != nil {
		b.close()
		return nil, fmt.Errorf("etcd: %w", err)
	}
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
		b.close()
		return nil, err
	}
	if _, err := migrations.Up(ctx, pool, schema); err != nil {
		b.close()
		return nil, err
	}
	for _, st := range []string{
		"CREATE TABLE " + schema + ".floor (id int PRIMARY KEY, v bigint NOT NULL) WITH (fillfactor = 10)",
		"INSERT INTO " + schema + ".floor SELECT g, 0 FROM generate_series(0, 64) g",
		"CREATE TABLE " + schema + ".events (id bigserial PRIMARY KEY, payload text)",
		// The handshake without WAL, measured against the row lock: a
		// guard that takes a transaction-level shared advisory lock on the
		// lease (a takeover would take it exclusively) and reads the token
		// without locking its row. Not pgfence's check; see BENCHMARKS.md.
		`CREATE FUNCTION ` + schema + `.check_advisory(p_name text, p_token bigint) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE cur bigint;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended(p_name, 0));
    SELECT l.token INTO cur FROM ` + schema + `.pgfence_leases l WHERE l.name = p_name;
    IF NOT FOUND OR cur <> p_token THEN
        RAISE EXCEPTION 'stale token % for lease % (current %)', p_token, p_name, cur USING ERRCODE = 'PF001';
    END IF;
    RETURN cur;
END $$`,
	} {
		if _, err := pool.Exec(ctx, st); err != nil {
			b.close()
			return nil, err
		}
	}
	return b, nil
}

func (b *bench) close() {
	b.pool.Close()
	_ = b.redis.Close()
	if b.etcd != nil {
		b.etcd.stop()
	}
}

func (b *bench) header(ctx context.Context) string {
	var version, fsync, syncCommit, sharedBuffers string
	_ = b.pool.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('fsync'),
		current_setting('synchronous_commit'), current_setting('shared_buffers')`).Scan(&version, &fsync, &syncCommit, &sharedBuffers)
	cpu := "unknown CPU"
	if out, err := exec.Command("sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").Output(); err == nil {
		cpu = strings.TrimSpace(string(out))
	}
	redisVersion := "?"
	if info, err := b.redis.Info(ctx, "server").Result(); err == nil {
		for _, l := range strings.Split(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(l), "redis_version:"); ok {
				redisVersion = v
			}
		}
	}
	return fmt.Sprintf("Generated by `go run -C bench . -write ../BENCHMARKS.md` on %s: %d cores (%s), %s, "+
		"PostgreSQL %s on 127.0.0.1 (fsync = %s, synchronous_commit = %s, shared_buffers = %s), Redis %s on 127.0.0.1 "+
		"(no persistence), etcd %s on 127.0.0.1 (one member, its data on the same disk, fsync on). Each figure: median over the rounds, [min – max], rounds; the forms of a table take turns "+
		"within each round.\n", time.Now().UTC().Format("2006-01-02"), runtime.NumCPU(), cpu, runtime.Version(),
		version, fsync, syncCommit, sharedBuffers, redisVersion, b.etcd.version(ctx))
}

// op is one client's unit of work: it reports whether it counted (a try
// lock that found the lock taken does not).
type op func(ctx context.Context) (bool, error)

// form makes one op per client; the cleanup runs after the measurement.
type form struct {
	name    string
	durable string
	make    func(ctx context.Context, client int, shared bool) (op, func(), error)
}

// measure runs clients ops for d and returns counted ops per second.
func measure(ctx context.Context, f form, clients int, shared bool, d time.Duration) (float64, error) {
	n, took, err := count(ctx, f, clients, shared, d)
	return float64(n) / took.Seconds(), err
}

// count runs clients ops for d and returns how many counted and how long
// they took.
func count(ctx context.Context, f form, clients int, shared bool, d time.Duration) (int, time.Duration, error) {
	ops := make([]op, clients)
	for i := range ops {
		o, done, err := f.make(ctx, i, shared)
		if err != nil {
			return 0, 0, fmt.Errorf("%s: %w", f.name, err)
		}
		defer done()
		ops[i] = o
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		total int
		first error
	)
	deadline := time.Now().Add(d)
	start := time.Now()
	for _, o := range ops {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := 0
			for time.Now().Before(deadline) {
				ok, err := o(ctx)
				if err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
				if ok {
					n++
				}
			}
			mu.Lock()
			total += n
			mu.Unlock()
		}()
	}
	wg.Wait()
	if first != nil {
		return 0, 0, fmt.Errorf("%s: %w", f.name, first)
	}
	return total, time.Since(start), nil
}

// table measures forms in rounds at each client count and mode and writes
// one row per form with the ratio to the form named by baseline(form).
func table(ctx context.Context, out *bytes.Buffer, unit string, forms []form, modes []string,
	clientCounts []int, rounds int, d time.Duration, baseline func(form) string) error {
	fmt.Fprintln(out)
	for _, mode := range modes {
		for _, clients := range clientCounts {
			res := map[string][]float64{}
			ratio := map[string][]float64{}
			for range rounds {
				got := map[string]float64{}
				for _, f := range forms {
					v, err := measure(ctx, f, clients, mode == "one shared name" || mode == "one shared lease", d)
					if err != nil {
						return err
					}
					got[f.name] = v
					res[f.name] = append(res[f.name], v)
				}
				for _, f := range forms {
					if base := baseline(f); base != "" && got[base] > 0 {
						ratio[f.name] = append(ratio[f.name], got[f.name]/got[base])
					}
				}
			}
			fmt.Fprintf(out, "**%d client(s), %s**\n\n| form | durable | %s | ratio to | ratio |\n|---|---|---|---|---|\n", clients, mode, unit)
			for _, f := range forms {
				r := "–"
				if rs := ratio[f.name]; len(rs) > 0 {
					r = summary(rs, "%.2f")
				}
				base := baseline(f)
				if base == "" {
					base = "–"
				}
				fmt.Fprintf(out, "| %s | %s | %s | %s | %s |\n", f.name, f.durable, summary(res[f.name], "%.0f"), base, r)
			}
			fmt.Fprintln(out)
		}
	}
	return nil
}

func summary(vs []float64, format string) string {
	s := append([]float64(nil), vs...)
	sort.Float64s(s)
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return fmt.Sprintf(format+" [%s – %s] ×%d", med, fmt.Sprintf(format, s[0]), fmt.Sprintf(format, s[len(s)-1]), len(s))
}

const (
	floorDurable = "floor: two durable commits"
	floorAsync   = "floor: a durable and an asynchronous commit"
	pgfenceDef   = "pgfence (default: asynchronous release)"
	pgfenceDur   = "pgfence, DurableRelease"
)

func (b *bench) pairs(ctx context.Context, out *bytes.Buffer, rounds int, d time.Duration) error {
	fmt.Fprint(out, "\n### Acquire + release pairs per second\n\nA pair is one acquisition and its release (floors: two single-row UPDATE commits, the second "+
		"with `synchronous_commit = off` for the like-for-like floor of the default). On one shared name, every "+
		"client tries the same lock and only successful pairs count (try-lock semantics for all forms).\n")
	forms, baseline := b.pairForms()
	return table(ctx, out, "pairs/s", forms, []string{"distinct names", "one shared name"}, []int{1, 8}, rounds, d, baseline)
}

// pairForms are the acquire+release forms, and the baseline of each.
func (b *bench) pairForms() ([]form, func(form) string) {
	upd := "UPDATE " + schema + ".floor SET v = v + 1 WHERE id = $1"
	floor := func(async bool) func(context.Context, int, bool) (op, func(), error) {
		second := upd
		if async {
			second = upd + " RETURNING set_config('synchronous_commit', 'off', true)"
		}
		return func(_ context.Context, client int, shared bool) (op, func(), error) {
			id := client + 1
			if shared {
				id = 0
			}
			return func(ctx context.Context) (bool, error) {
				if _, err := b.pool.Exec(ctx, upd, id); err != nil {
					return false, err
				}
				_, err := b.pool.Exec(ctx, second, id)
				return err == nil, err
			}, func() {}, nil
		}
	}
	pgfence := func(durable bool) func(context.Context, int, bool) (op, func(), error) {
		return func(_ context.Context, client int, shared bool) (op, func(), error) {
			c, err := lock.New(b.pool, lock.Config{Schema: schema, TTL: 15 * time.Second, DurableRelease: durable,
				Holder: fmt.Sprintf("bench-%d", client)})
			if err != nil {
				return nil, nil, err
			}
			name := leaseName(client, shared)
			return func(ctx context.Context) (bool, error) {
					l, err := c.TryAcquire(ctx, name)
					if errors.Is(err, lock.ErrHeld) {
						return false, nil
					}
					if err != nil {
						return false, err
					}
					return true, l.Release(ctx)
				}, func() {
					_ = c.Close(context.Background())
				}, nil
		}
	}
	advisory := func(ctx context.Context, client int, shared bool) (op, func(), error) {
		conn, err := b.pool.Acquire(ctx) // session-level locks: one connection
		if err != nil {
			return nil, nil, err
		}
		key := int64(client + 1)
		if shared {
			key = 0
		}
		return func(ctx context.Context) (bool, error) {
			var got bool
			if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1)", key).Scan(&got); err != nil || !got {
				return false, err
			}
			_, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1)", key)
			return err == nil, err
		}, conn.Release, nil
	}
	unlock := redis.NewScript(`if redis.call("get", KEYS[1]) == ARGV[1] then return redis.call("del", KEYS[1]) else return 0 end`)
	redisLock := func(_ context.Context, client int, shared bool) (op, func(), error) {
		key := "pgfence-bench:" + leaseName(client, shared)
		n := 0
		return func(ctx context.Context) (bool, error) {
			n++
			val := fmt.Sprintf("%d-%d", client, n)
			ok, err := b.redis.SetNX(ctx, key, val, 15*time.Second).Result()
			if err != nil || !ok {
				return false, err
			}
			return true, unlock.Run(ctx, b.redis, []string{key}, val).Err()
		}, func() {}, nil
	}
	forms := []form{
		{floorDurable, "yes", floor(false)},
		{floorAsync, "acquire only", floor(true)},
		{pgfenceDef, "acquire only", pgfence(false)},
		{pgfenceDur, "yes", pgfence(true)},
		{"`pg_try_advisory_lock` / `pg_advisory_unlock`", "no", advisory},
		{"Redis `SET NX PX` + compare-and-delete", "no", redisLock},
		{etcdForm, "yes", b.etcdPairs},
	}
	baseline := func(f form) string {
		switch f.name {
		case pgfenceDef:
			return floorAsync
		case pgfenceDur:
			return floorDurable
		case floorDurable, floorAsync:
			return ""
		}
		return pgfenceDef
	}
	return forms, baseline
}

func leaseName(client int, shared bool) string {
	if shared {
		return "bench-shared"
	}
	return fmt.Sprintf("bench-%d", client)
}

func (b *bench) guarded(ctx context.Context, out *bytes.Buffer, rounds int, d time.Duration) error {
	fmt.Fprint(out, "\n### Guarded transactions vs the same transaction unguarded\n\nThe transaction: BEGIN; INSERT one row; COMMIT "+
		"(Fold: the INSERT alone, autocommitted, carrying the check, against the INSERT alone). With many leases each client holds its own "+
		"lease (and resource); with one shared lease all clients write under the same token.\n")
	forms, baseline, done, err := b.guardForms(0)
	if err != nil {
		return err
	}
	forms = withoutPrototype(forms)
	err = table(ctx, out, "tx/s", forms, []string{"many leases", "one shared lease"}, []int{1, 8}, rounds, d, baseline)
	done() // its leases are the next forms' too
	if err != nil {
		return err
	}
	fmt.Fprint(out, "The guard's cost is per transaction (one more statement and a row lock), so the ratio grows with the "+
		"transaction's own work. The same forms, each transaction sending four INSERTs (one round trip each) instead of one:\n")
	forms, baseline, done, err = b.guardForms(3)
	if err != nil {
		return err
	}
	forms = withoutPrototype(forms)
	defer done()
	return table(ctx, out, "tx/s", forms, []string{"many leases, four INSERTs per transaction"}, []int{8}, rounds, d, baseline)
}

// guardForms are the guarded transactions and their unguarded baselines;
// done closes the client that holds their leases. Each transaction sends
// 1+more INSERTs; with more > 0 the single-statement forms (Fold and its
// baseline) are left out.
func (b *bench) guardForms(more int) ([]form, func(form) string, func(), error) {
	holder, err := lock.New(b.pool, lock.Config{Schema: schema, TTL: time.Minute, Holder: "bench-guard"})
	if err != nil {
		return nil, nil, nil, err
	}
	leases := map[string]*lock.Lease{}
	lease := func(ctx context.Context, client int, shared bool) (*lock.Lease, error) {
		name := "guard-" + leaseName(client, shared)
		if l := leases[name]; l != nil {
			return l, nil
		}
		l, err := holder.TryAcquire(ctx, name)
		leases[name] = l
		return l, err
	}
	ins := "INSERT INTO " + schema + ".events (payload) VALUES ($1)"
	rest := func(ctx context.Context, tx pgx.Tx) error {
		for range more {
			if _, err := tx.Exec(ctx, ins, "x"); err != nil {
				return err
			}
		}
		return nil
	}
	// tx runs body, which sends the first INSERT, then the rest.
	tx := func(body func(ctx context.Context, tx pgx.Tx, l *lock.Lease, res fence.Resource) error) func(context.Context, int, bool) (op, func(), error) {
		return func(ctx context.Context, client int, shared bool) (op, func(), error) {
			l, err := lease(ctx, client, shared)
			if err != nil {
				return nil, nil, err
			}
			res := fence.Resource{Name: "res-" + leaseName(client, shared), Schema: schema}
			return func(ctx context.Context) (bool, error) {
				err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
					if err := body(ctx, tx, l, res); err != nil {
						return err
					}
					return rest(ctx, tx)
				})
				return err == nil, err
			}, func() {}, nil
		}
	}
	forms := []form{
		{"unguarded", "yes", tx(func(ctx context.Context, tx pgx.Tx, _ *lock.Lease, _ fence.Resource) error {
			_, err := tx.Exec(ctx, ins, "x")
			return err
		})},
		{"unguarded, the INSERT autocommitted", "yes", func(ctx context.Context, client int, shared bool) (op, func(), error) {
			return func(ctx context.Context) (bool, error) {
				_, err := b.pool.Exec(ctx, ins, "x")
				return err == nil, err
			}, func() {}, nil
		}},
		{"`Lease.RunTx` (check, then the body)", "yes", func(ctx context.Context, client int, shared bool) (op, func(), error) {
			l, err := lease(ctx, client, shared)
			if err != nil {
				return nil, nil, err
			}
			return func(ctx context.Context) (bool, error) {
				err := l.RunTx(ctx, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, ins, "x"); err != nil {
						return err
					}
					return rest(ctx, tx)
				})
				return err == nil, err
			}, func() {}, nil
		}},
		{"`Guard.Exec` (check pipelined)", "yes", tx(func(ctx context.Context, tx pgx.Tx, l *lock.Lease, _ fence.Resource) error {
			_, err := l.Guard().Exec(ctx, tx, ins, "x")
			return err
		})},
		{"`Guard.Check`, then the INSERT", "yes", tx(func(ctx context.Context, tx pgx.Tx, l *lock.Lease, _ fence.Resource) error {
			if err := l.Guard().Check(ctx, tx); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, ins, "x")
			return err
		})},
		{"`Guard.Fold` (one autocommitted statement)", "yes", func(ctx context.Context, client int, shared bool) (op, func(), error) {
			l, err := lease(ctx, client, shared)
			if err != nil {
				return nil, nil, err
			}
			f, err := l.Guard().Fold(1)
			if err != nil {
				return nil, nil, err
			}
			st := "INSERT INTO " + schema + ".events (payload) SELECT $1 FROM (SELECT " + f.Expr + ") f"
			args := append([]any{"x"}, f.Args...)
			return func(ctx context.Context) (bool, error) {
				_, err := b.pool.Exec(ctx, st, args...)
				return err == nil, err
			}, func() {}, nil
		}},
		{advisoryForm, "yes", tx(func(ctx context.Context, tx pgx.Tx, l *lock.Lease, _ fence.Resource) error {
			if _, err := tx.Exec(ctx, "SELECT "+schema+".check_advisory($1, $2)", l.Name(), int64(l.Token())); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, ins, "x")
			return err
		})},
		{"`Resource.Exec` (admission pipelined)", "yes", tx(func(ctx context.Context, tx pgx.Tx, l *lock.Lease, res fence.Resource) error {
			_, err := res.Exec(ctx, tx, l.Token(), ins, "x")
			return err
		})},
		{"`Resource.Admit`, then the INSERT", "yes", tx(func(ctx context.Context, tx pgx.Tx, l *lock.Lease, res fence.Resource) error {
			if err := res.Admit(ctx, tx, l.Token()); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, ins, "x")
			return err
		})},
	}
	if more > 0 {
		forms = slices.DeleteFunc(forms, func(f form) bool {
			return strings.Contains(f.name, "autocommitted") || strings.HasPrefix(f.name, "`Guard.Fold`")
		})
	}
	baseline := func(f form) string {
		switch {
		case strings.HasPrefix(f.name, "unguarded"):
			return ""
		case strings.HasPrefix(f.name, "`Guard.Fold`"):
			return "unguarded, the INSERT autocommitted"
		}
		return "unguarded"
	}
	return forms, baseline, func() { _ = holder.Close(context.Background()) }, nil
}

// handover measures release-to-acquisition: a client releases, another's
// blocked Acquire returns; with and without 4 connections of durable
// UPDATEs loading the server.
func (b *bench) handover(ctx context.Context, out *bytes.Buffer, n int) error {
	fmt.Fprintf(out, "\n### Handover\n\nTime from `Release` to the waiting `Acquire` returning in another client, %d handovers "+
		"each. Load: 4 connections committing single-row UPDATEs as fast as they can. Connections opened: new server connections of the pool during the handovers (the two clients, their waiters and listeners, and the load).\n\n"+
		"| server | p50 | p99 | max | connections opened |\n|---|---|---|---|---|\n", n)
	for _, loaded := range []bool{false, true} {
		stop := make(chan struct{})
		var wg sync.WaitGroup
		if loaded {
			for i := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						select {
						case <-stop:
							return
						default:
						}
						_, _ = b.pool.Exec(ctx, "UPDATE "+schema+".floor SET v = v + 1 WHERE id = $1", 40+i)
					}
				}()
			}
		}
		opened := b.pool.Stat().NewConnsCount()
		lat, err := b.handovers(ctx, n)
		opened = b.pool.Stat().NewConnsCount() - opened
		close(stop)
		wg.Wait()
		if err != nil {
			return err
		}
		label := "idle"
		if loaded {
			label = "under load"
		}
		fmt.Fprintf(out, "| %s | %s | %s | %s | %d |\n", label, ms(lat[len(lat)/2]), ms(lat[len(lat)*99/100]), ms(lat[len(lat)-1]), opened)
	}
	lat, err := b.etcdHandovers(ctx, n)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	fmt.Fprintf(out, "| etcd `Mutex`: Unlock to the waiting Lock, idle | %s | %s | %s | – |\n", ms(lat[len(lat)/2]), ms(lat[len(lat)*99/100]), ms(lat[len(lat)-1]))
	return nil
}

func (b *bench) handovers(ctx context.Context, n int) ([]time.Duration, error) {
	var cs [2]*lock.Client
	for i := range cs {
		c, err := lock.New(b.pool, lock.Config{Schema: schema, TTL: 15 * time.Second, Holder: fmt.Sprintf("handover-%d", i)})
		if err != nil {
			return nil, err
		}
		defer c.Close(context.Background())
		cs[i] = c
	}
	held, err := cs[0].Acquire(ctx, "bench-handover")
	if err != nil {
		return nil, err
	}
	lat := make([]time.Duration, 0, n)
	for i := range n {
		next := cs[(i+1)%2]
		got := acquireAsync(ctx, next, "bench-handover")
		time.Sleep(20 * time.Millisecond) // the waiter is waiting
		released := time.Now()
		if err := held.Release(ctx); err != nil {
			return nil, err
		}
		r := <-got
		if r.err != nil {
			return nil, r.err
		}
		lat = append(lat, r.at.Sub(released))
		held = r.l
	}
	_ = held.Release(ctx)
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return lat, nil
}

// acquired is what a blocking Acquire returned, and when.
type acquired struct {
	l   *lock.Lease
	at  time.Time
	err error
}

// acquireAsync starts c.Acquire(ctx, name) and delivers its result.
func acquireAsync(ctx context.Context, c *lock.Client, name string) <-chan acquired {
	got := make(chan acquired, 1)
	go func() {
		l, err := c.Acquire(ctx, name)
		got <- acquired{l, time.Now(), err}
	}()
	return got
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

// splice replaces what lies between the generated-section markers of path.
func splice(path, block string, body []byte) error {
	begin, end := "<!-- "+block+":begin -->\n", "<!-- "+block+":end -->"
	old, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	i, j := bytes.Index(old, []byte(begin)), bytes.Index(old, []byte(end))
	if i < 0 || j < i {
		return fmt.Errorf("%s has no %q ... %q markers", path, strings.TrimSpace(begin), end)
	}
	var buf bytes.Buffer
	buf.Write(old[:i+len(begin)])
	buf.Write(body)
	buf.Write(old[j:])
	return os.WriteFile(path, buf.Bytes(), 0o644)
}

func firstNonEmpty(vs ...string) string {
	for _, v := range vs {
		if v != "" {
			return v
		}
	}
	return ""
}

// advisoryForm measures the handshake without WAL: a shared advisory lock
// instead of the row lock. It is in "Where the time goes" only; the
// guarded tables measured it in rounds once, for the verdict in
// BENCHMARKS.md, and left it out since to keep the command within 10
// minutes.
const advisoryForm = "prototype: shared advisory xact lock + token read, then the INSERT (not pgfence's check)"

func withoutPrototype(forms []form) []form {
	return slices.DeleteFunc(forms, func(f form) bool { return f.name == advisoryForm })
}
