package lock_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/expiry"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/clock"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
)

// 64 goroutines race for one free lease; exactly one wins.
func TestRaceExactlyOneWinner(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	clients := make([]*lock.Client, 8)
	for i := range clients {
		clients[i] = newClient(t, db, lock.Config{TTL: 30 * time.Second})
	}
	const n = 64
	var (
		wg       sync.WaitGroup
		start    = make(chan struct{})
		wins     atomic.Int32
		held     atomic.Int32
		mu       sync.Mutex
		won      *lock.Lease
		heldErrs []*lock.HeldError
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			l, err := clients[i%len(clients)].TryAcquire(ctx, "race")
			switch {
			case err == nil:
				wins.Add(1)
				mu.Lock()
				won = l
				mu.Unlock()
			case errors.Is(err, lock.ErrHeld):
				held.Add(1)
				var he *lock.HeldError
				if errors.As(err, &he) {
					mu.Lock()
					heldErrs = append(heldErrs, he)
					mu.Unlock()
				}
			default:
				t.Errorf("TryAcquire: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if wins.Load() != 1 || held.Load() != n-1 {
		t.Fatalf("wins=%d held=%d, want 1 and %d", wins.Load(), held.Load(), n-1)
	}
	// Every loser was told who won, with the winner's token (losers' attempts
	// may have drawn sequence values, so the token need not be 1).
	for _, he := range heldErrs {
		if he.Token != won.Token() || he.Holder != won.Holder() {
			t.Fatalf("HeldError %+v, want holder %q token %d", he, won.Holder(), won.Token())
		}
	}
}

// Over 1,000 acquire/release rounds by competing clients, the
// tokens handed out are strictly increasing with no repeats.
func TestTokensStrictlyIncreaseUnderContention(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, 2*time.Minute)
	const rounds, workers = 1000, 8
	var (
		mu     sync.Mutex
		tokens []fence.Token
		left   atomic.Int32
		wg     sync.WaitGroup
	)
	left.Store(rounds)
	for range workers {
		c := newClient(t, db, lock.Config{TTL: 30 * time.Second, PollInterval: 50 * time.Millisecond})
		wg.Add(1)
		go func() {
			defer wg.Done()
			for left.Add(-1) >= 0 {
				l, err := c.Acquire(ctx, "rounds")
				if err != nil {
					t.Errorf("Acquire: %v", err)
					return
				}
				// Appending while holding the lease orders the slice by
				// acquisition.
				mu.Lock()
				tokens = append(tokens, l.Token())
				mu.Unlock()
				if err := l.Release(ctx); err != nil {
					t.Errorf("Release: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if len(tokens) != rounds {
		t.Fatalf("got %d tokens, want %d", len(tokens), rounds)
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Fatalf("token %d at round %d is not greater than %d before it", tokens[i], i, tokens[i-1])
		}
	}
	t.Logf("%d rounds, tokens %d..%d", rounds, tokens[0], tokens[len(tokens)-1])
}

// Renewal keeps the token; release then re-acquire yields a
// greater token; a stale handle's release does nothing to the new holder.
func TestRenewReleaseReacquire(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	// A 3 s TTL: a loaded machine can hold a renewal back for more than a
	// second, which would lose a 1 s lease before the test looks at it.
	cfg := lock.Config{TTL: 3 * time.Second, RenewInterval: 500 * time.Millisecond, SafetyMargin: 300 * time.Millisecond}
	c := newClient(t, db, cfg)
	l, err := c.TryAcquire(ctx, "renew")
	if err != nil {
		t.Fatal(err)
	}
	first, acquired := l.ExpiresAt(), time.Now()
	// Alive after two TTLs only if renewed; judged after the renewals
	// happened, however long a loaded machine takes for them.
	pgtest.Eventually(t, 30*time.Second, "two TTLs of renewals", func() bool {
		return c.Stats().Renewals >= 8 && time.Since(acquired) > 2*cfg.TTL || c.Stats().Held == 0
	})
	if err := l.Check(ctx); err != nil {
		t.Fatalf("lease not kept alive by renewal: %v", err)
	}
	if !l.ExpiresAt().After(first) {
		t.Fatalf("expiry did not move: %v then %v", first, l.ExpiresAt())
	}
	var dbToken int64
	if err := db.Pool.QueryRow(ctx, "SELECT token FROM "+db.Schema+".pgfence_leases WHERE name='renew'").Scan(&dbToken); err != nil {
		t.Fatal(err)
	}
	if fence.Token(dbToken) != l.Token() {
		t.Fatalf("renewal changed the token: %d -> %d", l.Token(), dbToken)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("second Release: %v", err)
	}
	if !errors.Is(l.Err(), lock.ErrReleased) {
		t.Fatalf("Err after release = %v", l.Err())
	}
	l2, err := c.TryAcquire(ctx, "renew")
	if err != nil {
		t.Fatal(err)
	}
	if l2.Token() <= l.Token() {
		t.Fatalf("re-acquired token %d not greater than %d", l2.Token(), l.Token())
	}

	// Takeover: expire l2 at the database, let another client take it,
	// then release through the stale handle.
	other := newClient(t, db, lock.Config{TTL: 30 * time.Second})
	expire(t, db, "renew")
	l3, err := other.TryAcquire(ctx, "renew")
	if err != nil {
		t.Fatalf("takeover: %v", err)
	}
	if err := l2.Release(ctx); err != nil {
		t.Fatalf("stale release: %v", err)
	}
	if err := l3.Check(ctx); err != nil {
		t.Fatalf("new holder harmed by stale release: %v", err)
	}
	if _, err := c.TryAcquire(ctx, "renew"); !errors.Is(err, lock.ErrHeld) {
		t.Fatalf("lease free after stale release: %v", err)
	}
}

// expire moves a lease's expiry into the past at the database.
func expire(t testing.TB, db *pgtest.DB, name string) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), expiry.SQL(db.Schema), name)
	if err != nil {
		t.Fatal(err)
	}
}

// Renewals blocked: a holder whose renewals cannot get
// through ends its lease no later than its trust deadline, and before another
// client can acquire it.
func TestLeaseEndsBeforeTakeoverWhenRenewalsBlocked(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	ttl := 1200 * time.Millisecond
	app := pgtest.UniqueName("holder")
	holderPool := pgtest.NewPool(t, app)
	holder, err := lock.New(holderPool, lock.Config{TTL: ttl, RenewInterval: 200 * time.Millisecond,
		SafetyMargin: 100 * time.Millisecond, Schema: db.Schema, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close(context.Background())
	other := newClient(t, db, lock.Config{TTL: ttl, PollInterval: 20 * time.Millisecond})

	l, err := holder.TryAcquire(ctx, "blocked")
	if err != nil {
		t.Fatal(err)
	}
	// Block renewals: an admin transaction holds the session row's FOR
	// UPDATE lock (which renewal's UPDATE needs), and the holder's backends
	// are killed.
	admin, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Rollback(context.Background()) })
	if _, err := admin.Exec(ctx, "SELECT 1 FROM "+pgx.Identifier{db.Schema, "pgfence_sessions"}.Sanitize()+" WHERE id = "+
		"(SELECT session FROM "+pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()+" WHERE name = 'blocked') FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	ended := make(chan time.Time, 1) // when the lease ends, even while Terminate waits
	go func() { <-l.Done(); ended <- time.Now() }()
	killed := pgtest.Terminate(t, db.Pool, app)

	var doneAt time.Time
	select {
	case doneAt = <-ended:
	case <-time.After(5 * ttl):
		t.Fatal("lease context never cancelled")
	}
	// The deadline it ended at: read now, it counts a renewal that
	// committed before the row was locked and whose answer came after.
	trustDeadline := l.TrustedUntil()
	// The timer fires at the deadline; allow for scheduling latency on a
	// loaded 2-core machine. What must hold strictly is checked below: the
	// lease ends before anyone else can acquire it.
	if doneAt.After(trustDeadline.Add(250 * time.Millisecond)) {
		t.Fatalf("lease ended %v after its trust deadline", doneAt.Sub(trustDeadline))
	}
	if !errors.Is(l.Err(), lock.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", l.Err())
	}
	// Let the takeover through and see when it succeeds.
	if err := admin.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	l2, err := other.Acquire(ctx, "blocked")
	if err != nil {
		t.Fatal(err)
	}
	acquiredAt := time.Now()
	if !doneAt.Before(acquiredAt) {
		t.Fatalf("holder's lease ended at %v, after the takeover at %v", doneAt, acquiredAt)
	}
	if l2.Token() <= l.Token() {
		t.Fatalf("takeover token %d not greater than %d", l2.Token(), l.Token())
	}
	t.Logf("killed %d backends; lease ended %v after its trust deadline (timer latency); takeover %v after loss",
		killed, doneAt.Sub(trustDeadline), acquiredAt.Sub(doneAt))
}

// A waiter gets the lease promptly after a release, through
// the notification (its polling interval is far longer than the bound).
//
// It runs alone (not parallel): the parallel tests' connections can keep
// the waiter's listener from connecting for seconds (its retries back off),
// and the waiter then finds the release only once it listens.
func TestWaiterWakesOnRelease(t *testing.T) {
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	holder := newClient(t, db, lock.Config{TTL: 30 * time.Second})
	waiter := newClient(t, db, lock.Config{TTL: 30 * time.Second, PollInterval: 20 * time.Second})
	l, err := holder.TryAcquire(ctx, "wake")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan time.Time, 1)
	go func() {
		l2, err := waiter.Acquire(ctx, "wake")
		if err != nil {
			t.Errorf("Acquire: %v", err)
			close(got)
			return
		}
		got <- time.Now()
		_ = l2.Release(ctx)
	}()
	// Once the waiter has asked the holder's release to notify (after
	// LISTEN is in place), it is parked on LISTEN.
	waitFor(t, 20*time.Second, func() bool {
		var asked bool
		err := db.Pool.QueryRow(ctx, "SELECT waiters_until > now() FROM "+pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()+" WHERE name = 'wake'").Scan(&asked)
		return err == nil && asked
	})
	released := time.Now()
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	at, ok := <-got
	if !ok {
		t.FailNow()
	}
	lat := at.Sub(released)
	t.Logf("waiter acquired %v after release", lat)
	if lat > 3*time.Second {
		t.Fatalf("waiter took %v after release (poll interval 20s: notification missed)", lat)
	}
}

// Expiry is judged by the database clock. The client sends no
// time at all; moving the row's expiry decides who may acquire.
func TestExpiryIsJudgedByDatabaseClock(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	tbl := pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()
	c := newClient(t, db, lock.Config{TTL: 2 * time.Second, RenewInterval: 500 * time.Millisecond})

	// A holder whose row says "expires in an hour" by the database clock
	// holds, whatever the client thinks of time.
	var ghost int64
	if err := db.Pool.QueryRow(ctx, `WITH s AS (INSERT INTO `+db.Schema+`.pgfence_sessions (holder, started_at, renewed_at, expires_at)
		VALUES ('ghost', now(), now(), now() + interval '1 hour') RETURNING id)
		INSERT INTO `+tbl+` (name, holder, secret, session, acquired_at)
		SELECT 'clock', 'ghost', '\x00', s.id, now() - interval '2 hours' FROM s RETURNING token`).Scan(&ghost); err != nil {
		t.Fatal(err)
	}
	_, err := c.TryAcquire(ctx, "clock")
	var held *lock.HeldError
	if !errors.As(err, &held) {
		t.Fatalf("TryAcquire = %v, want *HeldError", err)
	}
	if held.Holder != "ghost" || int64(held.Token) != ghost || held.ExpiresIn < 59*time.Minute || held.ExpiresIn > time.Hour {
		t.Fatalf("HeldError = %+v, want ghost's token %d", held, ghost)
	}
	// Move the database's view: expired now. The same client acquires.
	expire(t, db, "clock")
	l, err := c.TryAcquire(ctx, "clock")
	if err != nil {
		t.Fatalf("after expiry at the database: %v", err)
	}
	if int64(l.Token()) <= ghost {
		t.Fatalf("token = %d, want above the ghost's %d", l.Token(), ghost)
	}
	// And expiring a live holder's row at the database ends its lease at
	// a next renewal, though its renewals go through and its local trust
	// window would keep it (5 s: ten RenewIntervals, room for a loaded
	// machine; the race-enabled full run once missed 1.5 s).
	expire(t, db, "clock")
	waitLost(t, l, 5*time.Second, "holder kept its lease after the database expired it")
}

// The schema refuses a token decrease, deletes and truncation.
// Only the INSERT that just drew a token from the sequence may use it: a
// session that acquired a lease (currval stays set for the whole session,
// as on a pooled connection) cannot insert a row reusing that token, or
// reusing one that an earlier row of the same INSERT drew; an INSERT that
// lets the column draw its token is accepted, on that same session.
func TestInsertCannotReuseTheSessionsLastToken(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	tbl := pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()
	c := newClient(t, db, lock.Config{})
	l, err := c.TryAcquire(ctx, "held")
	if err != nil {
		t.Fatal(err)
	}
	_ = l.Release(ctx)
	conn, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var drawn int64 // this connection acquires "held", as the library does
	if err := conn.QueryRow(ctx, "UPDATE "+tbl+" SET token = DEFAULT, holder = 'h', secret = 'x' WHERE name = 'held' RETURNING token").Scan(&drawn); err != nil {
		t.Fatal(err)
	}
	for _, stmt := range []string{
		fmt.Sprintf("INSERT INTO %s (name, token, acquired_at) OVERRIDING SYSTEM VALUE VALUES ('reuse', %d, now())", tbl, drawn),
		// The first row draws a token; the second reuses it.
		"INSERT INTO " + tbl + " (name, token, acquired_at) OVERRIDING SYSTEM VALUE" +
			" SELECT 'row' || i, CASE i WHEN 1 THEN nextval(pg_get_serial_sequence('" + tbl + "', 'token'))" +
			" ELSE currval(pg_get_serial_sequence('" + tbl + "', 'token')) END, now() FROM generate_series(1, 2) i",
	} {
		_, err := conn.Exec(ctx, stmt)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "PF010" {
			t.Errorf("%s: %v; want PF010", stmt, err)
		}
	}
	var fresh int64
	if err := conn.QueryRow(ctx, "INSERT INTO "+tbl+" (name, acquired_at) VALUES ('fresh', now()) RETURNING token").Scan(&fresh); err != nil || fresh <= drawn {
		t.Fatalf("INSERT drawing its own token on the same session: %d, %v; want a token above %d", fresh, err, drawn)
	}
	if _, err := conn.Exec(ctx, "INSERT INTO "+tbl+" (name, acquired_at) SELECT 'many' || i, now() FROM generate_series(1, 3) i"); err != nil {
		t.Fatalf("a multi-row INSERT drawing its tokens: %v", err)
	}
}

// The token is an identity column, so an UPDATE can only draw the next value
// of its sequence; an INSERT that overrides it with a value the sequence has
// not issued yet is refused by a trigger; renaming a row is allowed but cannot
// make any lease's token go down.
func TestSchemaRefusesTokenDecrease(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	tbl := pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()
	c := newClient(t, db, lock.Config{})
	l, err := c.TryAcquire(ctx, "mono")
	if err != nil {
		t.Fatal(err)
	}
	_ = l.Release(ctx)
	for _, tc := range []struct{ stmt, code string }{
		{"UPDATE " + tbl + " SET token = token - 1", "428C9"},
		{"UPDATE " + tbl + " SET token = 1", "428C9"},
		{"DELETE FROM " + tbl, "PF010"},
		{"TRUNCATE " + tbl, "PF010"},
		{"INSERT INTO " + tbl + " (name, token, acquired_at) OVERRIDING SYSTEM VALUE" +
			" VALUES ('forged', 1000000, now())", "PF010"},
		{"INSERT INTO " + tbl + " (name, token, acquired_at) OVERRIDING SYSTEM VALUE" +
			" VALUES ('zero', 0, now())", "PF010"},
		// The row rules checked at insert: name length, holder and secret
		// set together.
		{"INSERT INTO " + tbl + " (name, acquired_at) VALUES (repeat('n', 256), now())", "23514"},
		{"INSERT INTO " + tbl + " (name, acquired_at) VALUES ('', now())", "23514"},
		{"INSERT INTO " + tbl + " (name, holder, acquired_at) VALUES ('nosecret', 'h', now())", "23514"},
	} {
		_, err := db.Pool.Exec(ctx, tc.stmt)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != tc.code {
			t.Errorf("%s: err = %v, want SQLSTATE %s", tc.stmt, err, tc.code)
		}
	}
	var tok int64
	if err := db.Pool.QueryRow(ctx, "SELECT token FROM "+tbl+" WHERE name = 'mono'").Scan(&tok); err != nil || tok != int64(l.Token()) {
		t.Fatalf("token after refused statements = %d, %v; want %d", tok, err, l.Token())
	}
	// A renamed row takes its token along; the name's next acquisition
	// still gets a greater one, and so does the row's new name.
	if _, err := db.Pool.Exec(ctx, "UPDATE "+tbl+" SET name = 'renamed' WHERE name = 'mono'"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"mono", "renamed"} {
		l2, err := c.TryAcquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if l2.Token() <= l.Token() {
			t.Errorf("%s after rename: token %d, want above %d", name, l2.Token(), l.Token())
		}
		_ = l2.Release(ctx)
	}
	var persistence string
	if err := db.Pool.QueryRow(ctx, "SELECT relpersistence FROM pg_class WHERE oid = $1::regclass", tbl).Scan(&persistence); err != nil || persistence != "p" {
		t.Fatalf("leases table persistence = %q, %v; want permanent", persistence, err)
	}
}

// Bad input returns the documented errors, never a panic.
func TestBadInput(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	if _, err := lock.New(nil, lock.Config{}); !errors.Is(err, lock.ErrNilPool) {
		t.Errorf("nil pool: %v", err)
	}
	cfgs := []struct {
		cfg   lock.Config
		field string
	}{
		{lock.Config{TTL: -time.Second}, "TTL"},
		{lock.Config{RenewInterval: -time.Second}, "RenewInterval"},
		{lock.Config{SafetyMargin: -time.Second}, "SafetyMargin"},
		{lock.Config{PollInterval: -time.Second}, "PollInterval"},
		{lock.Config{TTL: time.Second, RenewInterval: 600 * time.Millisecond}, "RenewInterval"},
		{lock.Config{TTL: time.Second, RenewInterval: 400 * time.Millisecond, SafetyMargin: 700 * time.Millisecond}, "SafetyMargin"},
		{lock.Config{Holder: strings.Repeat("h", 256)}, "Holder"},
		{lock.Config{Holder: "\xff"}, "Holder"},
		{lock.Config{Schema: strings.Repeat("s", 64)}, "Schema"},
	}
	for _, tc := range cfgs {
		_, err := lock.New(db.Pool, tc.cfg)
		var ce *lock.ConfigError
		if !errors.As(err, &ce) || ce.Field != tc.field || !errors.Is(err, lock.ErrInvalidConfig) {
			t.Errorf("%+v: err = %v, want ConfigError on %s", tc.cfg, err, tc.field)
		}
	}
	c := newClient(t, db, lock.Config{})
	for _, name := range []string{"", strings.Repeat("n", 256), "bad\xffutf8", "nul\x00byte"} {
		if _, err := c.TryAcquire(ctx, name); !errors.Is(err, lock.ErrInvalidName) {
			t.Errorf("TryAcquire(%q): %v", name, err)
		}
		if _, err := c.Acquire(ctx, name); !errors.Is(err, lock.ErrInvalidName) {
			t.Errorf("Acquire(%q): %v", name, err)
		}
	}
	if _, err := c.TryAcquire(ctx, strings.Repeat("é", 127)); err != nil {
		t.Errorf("254-byte UTF-8 name refused: %v", err)
	}
	if err := (&lock.Election{Name: "x"}).Run(ctx); !errors.Is(err, lock.ErrInvalidElection) {
		t.Errorf("election without client: %v", err)
	}
	_ = c.Close(ctx)
	if _, err := c.TryAcquire(ctx, "after-close"); !errors.Is(err, lock.ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
}

// A client holding many leases renews them in one statement per interval
// (up to 5,000 leases a statement).
func TestBatchRenewalIsConstantStatements(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	counter := &stmtCounter{}
	pool := pgtest.NewPool(t, "renew-count", func(c *pgxpool.Config) { c.ConnConfig.Tracer = counter })
	c, err := lock.New(pool, lock.Config{TTL: 3 * time.Second, RenewInterval: 300 * time.Millisecond,
		SafetyMargin: 300 * time.Millisecond, Schema: db.Schema, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	const n = 50
	leases := make([]*lock.Lease, n)
	for i := range leases {
		if leases[i], err = c.TryAcquire(ctx, "many-"+string(rune('a'+i%26))+string(rune('a'+i/26))); err != nil {
			t.Fatal(err)
		}
	}
	counter.reset()
	time.Sleep(3 * time.Second) // a window of about 10 intervals
	renewals := counter.count("UPDATE")
	for _, l := range leases {
		if l.Err() != nil {
			t.Fatalf("lease %s lost: %v", l.Name(), l.Err())
		}
	}
	// About 10 intervals passed; one statement each, not 50.
	if renewals < 3 || renewals > 15 {
		t.Fatalf("%d renewal statements in ~10 intervals for %d leases; want one per interval", renewals, n)
	}
	t.Logf("%d leases renewed with %d statements in 1s", n, renewals)
}

type stmtCounter struct {
	mu    sync.Mutex
	stmts []string
}

func (s *stmtCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.mu.Lock()
	s.stmts = append(s.stmts, d.SQL)
	s.mu.Unlock()
	return ctx
}

func (s *stmtCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// Statements sent in a batch (pipelined) count one each.
func (s *stmtCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (s *stmtCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	s.mu.Lock()
	s.stmts = append(s.stmts, d.SQL)
	s.mu.Unlock()
}

func (s *stmtCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (s *stmtCounter) total() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.stmts)
}

func (s *stmtCounter) reset() {
	s.mu.Lock()
	s.stmts = nil
	s.mu.Unlock()
}

func (s *stmtCounter) count(prefix string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, q := range s.stmts {
		if strings.HasPrefix(strings.TrimSpace(q), prefix) {
			n++
		}
	}
	return n
}

// Operators: list leases and force-release one; the old holder loses it and
// the next holder gets a greater token.
func TestLeasesAndForceRelease(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c := newClient(t, db, lock.Config{Holder: "worker-1", TTL: 3 * time.Second, RenewInterval: 100 * time.Millisecond})
	l, err := c.TryAcquire(ctx, "ops")
	if err != nil {
		t.Fatal(err)
	}
	infos, err := lock.Leases(ctx, c.Pool(), c.Config().Schema)
	if err != nil || len(infos) != 1 {
		t.Fatalf("Leases = %v, %v", infos, err)
	}
	if i := infos[0]; i.Name != "ops" || i.Holder != "worker-1" || !i.Held || i.Token != l.Token() || i.ExpiresIn <= 0 || i.ExpiresIn > 3*time.Second {
		t.Fatalf("Info = %+v", i)
	}
	if _, err := lock.ForceRelease(ctx, c.Pool(), c.Config().Schema, "nope"); !errors.Is(err, lock.ErrNoLease) {
		t.Fatalf("ForceRelease(nope) = %v", err)
	}
	freed, err := lock.ForceRelease(ctx, c.Pool(), c.Config().Schema, "ops")
	holder, tok := freed.Holder, freed.Token
	if err != nil || holder != "worker-1" || tok != l.Token() {
		t.Fatalf("ForceRelease = %q, %d, %v", holder, tok, err)
	}
	waitLost(t, l, 10*time.Second, "holder did not notice the forced release")
	l2, err := c.TryAcquire(ctx, "ops")
	if err != nil || l2.Token() <= l.Token() {
		t.Fatalf("after force release: %v, %v", l2, err)
	}
}

// Acquire returns only live leases. An acquisition that waits
// behind an open guarded transaction for longer than the whole TTL comes back
// with its trust window over (and, before the fix, with a database expiry
// already past: now() is the statement start, before the wait). It is
// renewed before it is returned: live locally and at the database.
func TestLateAcquisitionIsLiveWhenReturned(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	// A TTL of 6 s: a renewal may be two seconds late on a loaded machine
	// (a 1 s TTL lost the lease under load, and a 3 s one once in CI with
	// the race detector), and the test waits out two.
	cfg := lock.Config{TTL: 6 * time.Second, RenewInterval: time.Second, SafetyMargin: 300 * time.Millisecond}
	// The first holder's guarded transaction stays open, idle, past the
	// TTL on purpose: without an idle bound, and for a taker that waits
	// for it instead of ending it.
	first := newClient(t, db, cfg)
	wcfg := cfg
	wcfg.IdleHolderAfter = -1
	c := newClient(t, db, wcfg)
	old, err := first.TryAcquire(ctx, "late")
	if err != nil {
		t.Fatal(err)
	}
	// A guarded transaction of the first holder stays open for 2 TTLs,
	// while the holder releases the lease (which does not wait for it).
	guarded, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Guard().Check(ctx, guarded); err != nil {
		_ = guarded.Rollback(ctx)
		t.Fatal(err)
	}
	ended := make(chan struct{})
	time.AfterFunc(2*cfg.TTL, func() { _ = guarded.Rollback(context.Background()); close(ended) })
	defer func() { <-ended }()
	if err := old.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l, err := c.Acquire(ctx, "late")
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Err(); err != nil || l.TimeLeft() < cfg.RenewInterval {
		t.Fatalf("returned lease: Err %v, TimeLeft %v; want live with at least %v", err, l.TimeLeft(), cfg.RenewInterval)
	}
	var live bool
	if err := db.Pool.QueryRow(ctx, "SELECT expires_at > clock_timestamp() FROM "+
		pgx.Identifier{db.Schema, "pgfence_lease_states"}.Sanitize()+" WHERE name = 'late'").Scan(&live); err != nil || !live {
		t.Fatalf("database expiry of the returned lease has passed (%v)", err)
	}
	// And it stays live: the renewer keeps it (three renewals, waited for).
	before := c.Stats().Renewals
	pgtest.Eventually(t, 40*time.Second, "three renewals of the returned lease", func() bool {
		return c.Stats().Renewals-before >= 3 || l.Err() != nil
	})
	if err := l.Err(); err != nil {
		t.Fatalf("lease ended after return: %v", err)
	}
}

// Stats: renewals counted, latency and clock skew measured (client and
// server share this machine's clock, so the skew is small), time left shrinks
// within the trust window.
func TestStats(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	// Renewals every 100 ms, in a 9 s trust window: a loaded machine's
	// stall of seconds does not lose the lease before Stats is read.
	c := newClient(t, db, lock.Config{TTL: 10 * time.Second, RenewInterval: 100 * time.Millisecond, SafetyMargin: time.Second})
	l, err := c.TryAcquire(ctx, "stats")
	if err != nil {
		t.Fatal(err)
	}
	if left := l.TimeLeft(); left <= 0 || left > 9*time.Second {
		t.Fatalf("TimeLeft = %v", left)
	}
	// Two renewals counted, however long a loaded machine takes for them.
	pgtest.Eventually(t, 30*time.Second, "two renewals", func() bool { return c.Stats().Renewals >= 2 })
	s := c.Stats()
	if s.Held != 1 || s.Renewals < 2 || s.LastRenewLatency <= 0 || s.LastRenewLatency > 5*time.Second {
		t.Fatalf("Stats = %+v", s)
	}
	if s.ClockSkew < -time.Second || s.ClockSkew > time.Second {
		t.Fatalf("ClockSkew = %v on one machine", s.ClockSkew)
	}
	_ = l.Release(ctx)
	if l.TimeLeft() != 0 || c.Stats().Held != 0 {
		t.Fatalf("after release: TimeLeft %v, Held %d", l.TimeLeft(), c.Stats().Held)
	}
	t.Logf("%+v", s)
}

// waitLost waits up to d for l to end with ErrLeaseLost, or fails with why.
func waitLost(t *testing.T, l *lock.Lease, d time.Duration, why string) {
	t.Helper()
	select {
	case <-l.Done():
	case <-time.After(d):
		t.Fatal(why)
	}
	if !errors.Is(l.Err(), lock.ErrLeaseLost) {
		t.Fatalf("cause = %v, want ErrLeaseLost", l.Err())
	}
}

// A forced release wakes blocked acquirers through the same notification as
// a release (the waiter's poll interval is far longer than the test).
func TestForceReleaseWakesWaiters(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	holder := newClient(t, db, lock.Config{Holder: "stuck"})
	waiter := newClient(t, db, lock.Config{Holder: "next", PollInterval: 30 * time.Second})
	l, err := holder.TryAcquire(ctx, "forced")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *lock.Lease, 1)
	go func() {
		l2, err := waiter.Acquire(ctx, "forced")
		if err != nil {
			t.Error(err)
		}
		got <- l2
	}()
	// Wait until the waiter has asked to be woken.
	waitFor(t, 5*time.Second, func() bool {
		var asked bool
		err := db.Pool.QueryRow(ctx, "SELECT waiters_until > now() FROM "+pgx.Identifier{db.Schema, "pgfence_leases"}.Sanitize()+" WHERE name = 'forced'").Scan(&asked)
		return err == nil && asked
	})
	if _, err := lock.ForceRelease(ctx, waiter.Pool(), waiter.Config().Schema, "forced"); err != nil {
		t.Fatal(err)
	}
	select {
	case l2 := <-got:
		if l2 == nil || l2.Token() <= l.Token() {
			t.Fatalf("waiter got %v after the forced release of token %d", l2, l.Token())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a waiter was not woken by the forced release")
	}
}

// waitFor polls cond every 10ms until it holds, failing the test after d.
func waitFor(t *testing.T, d time.Duration, cond func() bool) {
	t.Helper()
	pgtest.Eventually(t, d, "the condition", cond)
}

// An acquisition whose reply was lost (connection dropped after the commit)
// leaves the row held with the attempt's secret. Acquire keeps one secret
// across its attempts, so its next attempt adopts that lease at once instead
// of waiting for it to expire, under the client's session, which holds it.
// Another secret (any other acquirer, or TryAcquire) still finds it held.
func TestAcquireAdoptsItsLostAcquisition(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	cfg := lock.Config{TTL: 3 * time.Second, RenewInterval: 500 * time.Millisecond, SafetyMargin: 300 * time.Millisecond}
	c := newClient(t, db, cfg)
	secret, token, err := c.AcquireLostReply(ctx, "orphan")
	if err != nil {
		t.Fatal(err)
	}
	var held *lock.HeldError
	if _, err := c.TryAcquire(ctx, "orphan"); !errors.As(err, &held) || int64(held.Token) != token {
		t.Fatalf("TryAcquire with a fresh secret = %v, want held with token %d", err, token)
	}
	l, err := c.TryAcquireAs(ctx, "orphan", secret)
	if err != nil {
		t.Fatalf("adopting the lost acquisition: %v", err)
	}
	if int64(l.Token()) != token {
		t.Fatalf("adopted token %d, want %d", l.Token(), token)
	}
	// It is a lease like any other: renewed past its first expiry.
	time.Sleep(cfg.TTL + time.Second)
	if err := l.Check(ctx); err != nil {
		t.Fatalf("adopted lease after its first TTL: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A client whose Acquires wait for many leases spends one
// statement per poll interval on all of them (before: an UPDATE and an
// acquisition attempt per lease per interval), and its waiters still wake
// at once on release.
func TestWaitersPollOncePerInterval(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	holder := newClient(t, db, lock.Config{TTL: 30 * time.Second})
	const n = 40
	held := make([]*lock.Lease, n)
	for i := range held {
		var err error
		if held[i], err = holder.TryAcquire(ctx, fmt.Sprintf("job-%02d", i)); err != nil {
			t.Fatal(err)
		}
	}
	counter := &stmtCounter{}
	pool := pgtest.NewPool(t, "poll-count", func(c *pgxpool.Config) { c.ConnConfig.Tracer = counter })
	waiter, err := lock.New(pool, lock.Config{PollInterval: 100 * time.Millisecond, Schema: db.Schema, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer waiter.Close(context.Background())
	got := make(chan *lock.Lease, n)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for i := range n {
		go func() {
			l, err := waiter.Acquire(wctx, fmt.Sprintf("job-%02d", i))
			if err != nil {
				if wctx.Err() == nil {
					t.Error(err)
				}
				return
			}
			got <- l
		}()
	}
	// Every waiter has tried once (each failed attempt reads the holder)
	// and waits: the statements settle to the poller's (a loaded machine
	// may take seconds to get there, and may not have run every waiter's
	// goroutine yet when a quiet window is seen). The count below is an
	// upper bound, which load can only make easier to meet.
	pgtest.Eventually(t, 30*time.Second, "every waiter's first attempt", func() bool {
		return counter.count("SELECT l.token, coalesce(l.holder") >= n
	})
	pgtest.Eventually(t, 30*time.Second, "the waiters' first attempts to be over", func() bool {
		counter.reset()
		time.Sleep(300 * time.Millisecond)
		return counter.total() <= 6
	})
	counter.reset()
	time.Sleep(time.Second)
	stmts := counter.total()
	// About 10 intervals passed: one statement each (jitter ±25%), not 2n.
	if stmts > 16 {
		t.Fatalf("%d statements in ~10 poll intervals while waiting for %d leases; want about one per interval", stmts, n)
	}
	t.Logf("%d waiters sent %d statements in 10 poll intervals", n, stmts)
	for _, l := range held {
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for range n {
		select {
		case l := <-got:
			_ = l.Release(ctx)
		case <-time.After(5 * time.Second):
			t.Fatal("a waiter did not get its lease after the release")
		}
	}
}

// Close runs once: concurrent and later calls wait for the first and return
// its result, and the client refuses acquisitions afterwards.
func TestCloseIsIdempotent(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.TryAcquire(ctx, "closing")
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 4)
	for range 4 {
		go func() { errs <- c.Close(ctx) }()
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Errorf("concurrent Close: %v", err)
		}
	}
	if err := c.Close(ctx); err != nil {
		t.Errorf("Close again: %v", err)
	}
	if !errors.Is(l.Err(), lock.ErrReleased) {
		t.Errorf("the lease after Close: %v, want ErrReleased", l.Err())
	}
	if _, err := c.TryAcquire(ctx, "after-close"); !errors.Is(err, lock.ErrClosed) {
		t.Errorf("TryAcquire after Close: %v, want ErrClosed", err)
	}
}

// A lease is trusted until its acquisition's send time + TTL -
// SafetyMargin, by the client's clock, and not a moment longer: on a fake
// clock, with no sleeping, it is live 1ms before the deadline and lost at
// it, its context cancelled.
func TestTrustDeadlineOnAFakeClock(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	c, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, Logger: quiet}) // TTL 15s, SafetyMargin 1.5s
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	fake := clock.NewFake(time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))
	c.SetClock(fake)
	l, err := c.TryAcquire(ctx, "fake-clock")
	if err != nil {
		t.Fatal(err)
	}
	window := 13500 * time.Millisecond
	if got := l.TrustedUntil().Sub(fake.Now()); got != window {
		t.Fatalf("trusted for %v from the send, want TTL - SafetyMargin = %v", got, window)
	}
	// Advancing the clock past RenewInterval starts a renewal, at the
	// database; one that went through would move the deadline. The
	// session row stays locked, so none does.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, "SELECT 1 FROM "+db.Schema+".pgfence_sessions WHERE id = (SELECT session FROM "+
		db.Schema+".pgfence_leases WHERE name = 'fake-clock') FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	fake.Advance(window - time.Millisecond)
	if err := l.Err(); err != nil || l.TimeLeft() != time.Millisecond {
		t.Fatalf("1ms before the deadline: err %v, time left %v", err, l.TimeLeft())
	}
	fake.Advance(time.Millisecond)
	select {
	case <-l.Done():
	default:
		t.Fatal("the lease's context is live at its trust deadline")
	}
	if !errors.Is(l.Err(), lock.ErrLeaseLost) || l.TimeLeft() != 0 {
		t.Fatalf("at the deadline: err %v, time left %v; want ErrLeaseLost, 0", l.Err(), l.TimeLeft())
	}
}

// Inspect answers who holds a lease now, with which token and since when,
// and says so when it is free, taken over, or was never acquired.
func TestInspectSaysWhoHolds(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	a := newClient(t, db, lock.Config{Holder: "replica-a"})
	b := newClient(t, db, lock.Config{Holder: "replica-b"})
	if _, err := lock.Inspect(ctx, a.Pool(), a.Config().Schema, "nightly"); !errors.Is(err, lock.ErrNoLease) {
		t.Fatalf("Inspect of a name never acquired: %v, want ErrNoLease", err)
	}
	l, err := a.TryAcquire(ctx, "nightly")
	if err != nil {
		t.Fatal(err)
	}
	i, err := lock.Inspect(ctx, b.Pool(), b.Config().Schema, "nightly")
	if err != nil || i.Holder != "replica-a" || !i.Held || i.Token != l.Token() || i.AcquiredAt.IsZero() || i.ExpiresIn <= 0 {
		t.Fatalf("Inspect of a held lease: %+v, %v; want replica-a with token %s", i, err, l.Token())
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if i, err := lock.Inspect(ctx, b.Pool(), b.Config().Schema, "nightly"); err != nil || i.Held || i.Holder != "" || i.Token != l.Token() {
		t.Fatalf("Inspect of a released lease: %+v, %v; want free, last token %s", i, err, l.Token())
	}
	l2, err := b.TryAcquire(ctx, "nightly")
	if err != nil {
		t.Fatal(err)
	}
	if i, err := lock.Inspect(ctx, a.Pool(), a.Config().Schema, "nightly"); err != nil || i.Holder != "replica-b" || i.Token != l2.Token() || i.Token <= l.Token() {
		t.Fatalf("Inspect after a takeover: %+v, %v", i, err)
	}
	if _, err := lock.Inspect(ctx, a.Pool(), a.Config().Schema, ""); !errors.Is(err, lock.ErrInvalidName) {
		t.Fatalf("Inspect of an invalid name: %v", err)
	}
}

// Close releases every lease the client holds in a few statements, not one
// per lease: each lease ends with ErrReleased, and every row is free.
func TestCloseReleasesManyLeasesInFewStatements(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, 2*time.Minute)
	counter := &stmtCounter{}
	pool := pgtest.NewPool(t, "close-count", func(c *pgxpool.Config) { c.ConnConfig.Tracer = counter })
	c, err := lock.New(pool, lock.Config{Schema: db.Schema, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	const n = 10000
	leases := acquireMany(t, ctx, c, "close", n)
	counter.reset()
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if got := counter.count("UPDATE") + counter.count("WITH"); got > 5 {
		t.Fatalf("Close of %d leases sent %d UPDATE statements; want at most 5", n, got)
	}
	for _, l := range leases {
		if !errors.Is(l.Err(), lock.ErrReleased) {
			t.Fatalf("lease %s after Close: %v, want ErrReleased", l.Name(), l.Err())
		}
	}
	var held int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{db.Schema, "pgfence_lease_states"}.Sanitize()+
		" WHERE holder IS NOT NULL OR expires_at > now()").Scan(&held); err != nil || held != 0 {
		t.Fatalf("%d lease rows still held after Close (%v)", held, err)
	}
	t.Logf("Close released %d leases with %d statements", n, counter.total())
}

// acquireMany acquires the leases prefix-00000 ... prefix-(n-1) on c, with
// eight goroutines.
func acquireMany(t *testing.T, ctx context.Context, c *lock.Client, prefix string, n int) []*lock.Lease {
	t.Helper()
	const workers = 8
	leases := make([]*lock.Lease, n)
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += workers {
				l, err := c.TryAcquire(ctx, fmt.Sprintf("%s-%05d", prefix, i))
				if err != nil {
					errs <- err
					return
				}
				leases[i] = l
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	return leases
}

// RevokeTx issues a token above the holder's inside the caller's
// transaction: it waits for the holder's open guarded transaction (whose
// write commits first), and once it commits the holder's guarded writes
// are refused, the holder loses the lease, and the next acquisition gets a
// greater token still. A released lease's holder is reported as "", and a
// lease never acquired is ErrNoLease.
func TestRevokeTx(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := ctxT(t, time.Minute)
	holder := newClient(t, db, lock.Config{Holder: "holder"})
	waiter := newClient(t, db, lock.Config{Holder: "waiter", PollInterval: 30 * time.Second})
	data := pgx.Identifier{db.Schema, "data"}.Sanitize()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE "+data+" (v text)"); err != nil {
		t.Fatal(err)
	}
	l, err := holder.TryAcquire(ctx, "revoked")
	if err != nil {
		t.Fatal(err)
	}
	inTx, release := make(chan struct{}), make(chan struct{})
	wrote := make(chan error, 1)
	go func() {
		wrote <- l.RunTx(ctx, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO "+data+" VALUES ('holder')"); err != nil {
				return err
			}
			close(inTx)
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		})
	}()
	<-inTx
	type result struct {
		token  fence.Token
		holder string
		err    error
	}
	revoked := make(chan result, 1)
	go func() {
		var r result
		r.err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			var err error
			r.token, r.holder, err = lock.RevokeTx(ctx, tx, db.Schema, "revoked")
			return err
		})
		revoked <- r
	}()
	waitFor(t, 10*time.Second, func() bool { // the revocation waits on the lease row
		var waiting bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE '%'||$1||'%pgfence_leases%')`, db.Schema).Scan(&waiting)
		return err == nil && waiting
	})
	select {
	case r := <-revoked:
		t.Fatalf("RevokeTx returned while a guarded transaction of the current token was open: %+v", r)
	default:
	}
	close(release)
	if err := <-wrote; err != nil {
		t.Fatalf("the holder's guarded write that began first: %v", err)
	}
	r := <-revoked
	if r.err != nil || r.token <= l.Token() || r.holder != "holder" {
		t.Fatalf("RevokeTx: %+v; want a token above %v, holder \"holder\"", r, l.Token())
	}
	if err := l.RunTx(ctx, func(tx pgx.Tx) error { _, err := tx.Exec(ctx, "INSERT INTO "+data+" VALUES ('late')"); return err }); !errors.Is(err, fence.ErrFenced) {
		t.Fatalf("the holder's guarded write after the revocation: %v, want ErrFenced", err)
	}
	select {
	case <-l.Done():
	case <-ctx.Done():
		t.Fatal("the revoked holder never lost its lease")
	}
	next, err := waiter.Acquire(ctx, "revoked")
	if err != nil || next.Token() <= r.token {
		t.Fatalf("the next acquisition: %v, %v; want a token above the revoking %v", next, err, r.token)
	}
	if err := next.Release(ctx); err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, who, err := lock.RevokeTx(ctx, tx, db.Schema, "revoked")
		if err == nil && who != "" {
			err = fmt.Errorf("holder %q reported for a released lease", who)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, _, err := lock.RevokeTx(ctx, tx, db.Schema, "never"); return err })
	if !errors.Is(err, lock.ErrNoLease) {
		t.Fatalf("RevokeTx of a lease never acquired: %v, want ErrNoLease", err)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+data+" WHERE v = 'late'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("the revoked holder's late write: %d rows, %v", n, err)
	}
}
