package web_test

import (
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/web"
)

// A job's page, for a known history: its schedule in words and its next
// slots; its leader now; three terms on the leadership timeline (token 1
// by n1, 2 by n2, 3 by n3 leading now) with the stale n1's fenced attempt
// marked; four failures in a row; the attempts filtered by status and kind
// and paged; bad parameters answered 400 naming the parameter, an unknown
// job 404; and every job name on the jobs page links to its page.
func TestJobPage(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	seedHistory(t, db)
	h, err := web.New(db.Pool, web.Config{Schema: db.Schema, Attempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	base := httptestServer(t, h)

	code, _, page := get(t, base+"/job?name=billing")
	if code != http.StatusOK {
		t.Fatalf("job page: %d\n%s", code, page)
	}
	for _, want := range []string{
		"every day at 02:30 UTC", `<code>30 2 * * *</code>`, // the schedule, in words and as written
		"Job billing",
		`<td>n3</td>`, // the leader now
		`title>token 1, held by n1: from`, `title>token 2, held by n2: from`,
		`title>token 3, held by n3 since`, "leading now", ", 1 fenced",
		`<span class="warn">4</span>`, // failed in a row: three failures and the fencing since the last success
	} {
		if !strings.Contains(page, want) {
			t.Errorf("the job page lacks %q", want)
		}
	}
	if n := strings.Count(page, `:30:00 UTC</time>`); n < 3 {
		t.Errorf("%d of the next three slots at :30 shown", n)
	}
	leadership := page[strings.Index(page, `id="leadership"`):strings.Index(page, `id="run-timeline"`)]
	for what, want := range map[string]int{`<g class="term`: 3, `<g class="term term-current"`: 1, `class="fenced-mark"`: 1, `class="lane-label"`: 3} {
		if n := strings.Count(leadership, what); n != want {
			t.Errorf("leadership timeline: %d of %s, want %d", n, what, want)
		}
	}
	// The bars go left to right in token order.
	xs := regexp.MustCompile(`<g class="term[^"]*"><title>token (\d)[^<]*</title><rect x="([0-9.]+)"`).FindAllStringSubmatch(leadership, -1)
	if len(xs) != 3 || xs[0][1] != "1" || xs[1][1] != "2" || xs[2][1] != "3" || !(num(t, xs[0][2]) < num(t, xs[1][2]) && num(t, xs[1][2]) < num(t, xs[2][2])) {
		t.Errorf("terms' bars: %v; want tokens 1, 2, 3 from left to right", xs)
	}
	runChart := page[strings.Index(page, `id="run-timeline"`):strings.Index(page, `id="attempts"`)]
	if n := strings.Count(runChart, `<g class="run run-`); n != 3 {
		t.Errorf("run timeline: %d bars, want the 3 attempts of the page", n)
	}

	rows := func(page string) int {
		table := page[strings.Index(page, `<table id="runs">`):]
		return strings.Count(table[:strings.Index(table, "</table>")], " data-status=")
	}
	for _, tc := range []struct {
		query string
		rows  int
		older bool
	}{
		{"", 3, true}, {"&page=2", 3, true}, {"&page=3", 1, false},
		{"&status=fenced", 1, false}, {"&status=failed", 3, false}, {"&kind=manual", 1, false},
		{"&kind=manual&status=failed", 0, false},
	} {
		code, _, page := get(t, base+"/job?name=billing"+tc.query)
		if code != http.StatusOK || rows(page) != tc.rows || strings.Contains(page, `id="page-older"`) != tc.older {
			t.Errorf("?name=billing%s: %d, %d rows, older page linked %v; want 200, %d, %v", tc.query, code, rows(page),
				strings.Contains(page, `id="page-older"`), tc.rows, tc.older)
		}
	}
	if _, _, manual := get(t, base+"/job?name=billing&kind=manual"); !strings.Contains(manual, "asked by ops@example") {
		t.Errorf("the manual run does not say who asked for it")
	}
	for query, want := range map[string]string{ // html/template writes " as &#34;
		"?name=billing&status=bogus": `parameter &#34;status&#34;`, "?name=billing&kind=x": `parameter &#34;kind&#34;`,
		"?name=billing&page=0": `parameter &#34;page&#34;`, "": `parameter &#34;name&#34;`,
	} {
		if code, _, page := get(t, base+"/job"+query); code != http.StatusBadRequest || !strings.Contains(page, want) {
			t.Errorf("/job%s: %d; want 400 naming %s\n%s", query, code, want, page)
		}
	}
	if code, _, page := get(t, base+"/job?name=nope"); code != http.StatusNotFound || !strings.Contains(page, `no job named &#34;nope&#34; is registered`) {
		t.Errorf("an unknown job: %d\n%s", code, page)
	}
	if _, _, jobs := get(t, base+"/jobs"); !strings.Contains(jobs, `<a href="job?name=billing">billing</a>`) {
		t.Errorf("the jobs page does not link billing to its page")
	}
}

// seedHistory registers the job "billing" (daily at 02:30) with a known
// history: token 1 held by n1 (three attempts, the last fenced when n2 took
// over), token 2 by n2 (three failed attempts), and token 3 held now by n3,
// whose lease the test holds; on a fresh schema the tokens are 1, 2, 3.
func seedHistory(t *testing.T, db *pgtest.DB) {
	t.Helper()
	ctx := pgtest.Context(t, time.Minute)
	c := db.Client(t, lock.Config{Holder: "n3"})
	var tokens []int64 // n1's, n2's (the ledger below), then n3's, held now
	for i := range 3 {
		l, err := c.TryAcquire(ctx, "pgfence/job/billing")
		if err != nil {
			t.Fatal(err)
		}
		tokens = append(tokens, int64(l.Token()))
		if i < 2 {
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.pgfence_jobs (job, schedule, shards, max_attempts, registered_at, registered_by)
		 VALUES ('billing', '30 2 * * *', 0, 3, now(), 'n1')`); err != nil {
		t.Fatal(err)
	}
	runs := db.Schema + ".pgfence_runs"
	for _, q := range []string{
		`INSERT INTO ` + runs + ` (job, shard, kind, slot, attempt, token, status, holder, requested_by, started_at, finished_at, error)
		 SELECT 'billing', 0, k, now() - s * interval '1 hour', a, tok, st, h, r,
		        now() - s * interval '1 hour' + a * interval '1 minute', now() - s * interval '1 hour' + a * interval '1 minute' + interval '20 seconds', e
		   FROM (VALUES ('scheduled', 6, 1, $1::bigint, 'succeeded', 'n1', NULL, NULL),
		                ('manual',    5, 1, $1, 'succeeded', 'n1', 'ops@example', NULL),
		                ('scheduled', 4, 1, $1, 'succeeded', 'n1', NULL, NULL),
		                ('scheduled', 3, 1, $1, 'fenced', 'n1', NULL, 'stale token (a greater one was issued)'),
		                ('scheduled', 3, 2, $2::bigint, 'failed', 'n2', NULL, 'provider down'),
		                ('scheduled', 3, 3, $2, 'failed', 'n2', NULL, 'provider down'),
		                ('scheduled', 2, 1, $2, 'failed', 'n2', NULL, 'provider down')) v(k, s, a, tok, st, h, r, e)`,
	} {
		if _, err := db.Pool.Exec(ctx, q, tokens[0], tokens[1]); err != nil {
			t.Fatal(err)
		}
	}
}

func num(t *testing.T, s string) float64 {
	t.Helper()
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// The leases page lists held leases before free ones, the runner's leases
// in a table of their own, and the history a token was issued in only
// when a token predates the current one (none here).
func TestLeasesPageOrder(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	c := db.Client(t, lock.Config{Holder: "app-1"})
	for _, name := range []string{"a-free", "pgfence/job/x-free"} {
		l, err := c.TryAcquire(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range []string{"b-held", "pgfence/job/y-held"} {
		if _, err := c.TryAcquire(ctx, name); err != nil {
			t.Fatal(err)
		}
	}
	h, err := web.New(db.Pool, web.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	_, _, page := get(t, httptestServer(t, h)+"/")
	app := page[strings.Index(page, `<table id="leases">`):strings.Index(page, `<table id="runner-leases">`)]
	run := page[strings.Index(page, `<table id="runner-leases">`):]
	if i, j := strings.Index(app, `data-lease="b-held"`), strings.Index(app, `data-lease="a-free"`); i < 0 || j < 0 || i > j ||
		strings.Contains(app, `data-lease="pgfence/`) {
		t.Errorf("application leases: b-held at %d, a-free at %d, runner leases among them: %v", i, j, strings.Contains(app, `data-lease="pgfence/`))
	}
	if i, j := strings.Index(run, `data-lease="pgfence/job/y-held"`), strings.Index(run, `data-lease="pgfence/job/x-free"`); i < 0 || j < 0 || i > j {
		t.Errorf("runner leases: y-held at %d, x-free at %d; want held first", i, j)
	}
	if strings.Contains(page, "Issued in") || strings.Contains(page, "timeline 1</td>") {
		t.Errorf("the history column is shown though every token is of the current one")
	}
}

// Names with control and format characters reach no page raw: not the
// text, not the attributes (data-*, form values) of the leases page, the
// release confirmation or the jobs page.
func TestNoRawControlCharacters(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	const name = "ctl\x1b[2Jname\u202eevil"
	c := db.Client(t, lock.Config{Holder: "holder\x07"})
	if _, err := c.TryAcquire(ctx, name); err != nil {
		t.Fatal(err)
	}
	h, err := web.New(db.Pool, web.Config{Schema: db.Schema, AllowActions: true})
	if err != nil {
		t.Fatal(err)
	}
	base := httptestServer(t, h)
	for _, path := range []string{"/", "/release?name=" + url.QueryEscape(name), "/jobs"} {
		code, _, page := get(t, base+path)
		if code != http.StatusOK || strings.ContainsAny(page, "\x1b\u202e\x07") {
			t.Errorf("%s: %d, raw control or format characters: %v", path, code, strings.ContainsAny(page, "\x1b\u202e\x07"))
		}
	}
	// The confirmation's form still names the lease exactly: posting it
	// releases it.
	_, _, confirm := get(t, base+"/release?name="+url.QueryEscape(name))
	if !strings.Contains(confirm, `value="ctl&#x1b;[2Jname&#x202e;evil"`) {
		t.Fatalf("the confirmation's form value is not the name with references:\n%s", confirm)
	}
}

// The fleet page tells an instance that stopped cleanly from one that went
// without a word.
func TestFleetTellsStoppedFromGone(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := pgtest.Context(t, time.Minute)
	if _, err := db.Pool.Exec(ctx, `INSERT INTO `+db.Schema+`.pgfence_instances (id, started_at, heartbeat_at, expires_at, stopped_at) VALUES
		('crashed', now() - interval '1 hour', now() - interval '1 minute', now() - interval '30 seconds', NULL),
		('stopped', now() - interval '1 hour', now() - interval '1 minute', now() - interval '1 minute', now() - interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	h, err := web.New(db.Pool, web.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	_, _, page := get(t, httptestServer(t, h)+"/fleet")
	row := func(id string) string {
		i := strings.Index(page, `<th scope="row" class="name">`+id+`</th>`)
		if i < 0 {
			t.Fatalf("no row for %s:\n%s", id, page)
		}
		return page[i : i+strings.Index(page[i:], "</tr>")]
	}
	if r := row("stopped"); !strings.Contains(r, ">stopped</span>") || strings.Contains(r, "gone") {
		t.Errorf("the cleanly stopped instance: %s", r)
	}
	if r := row("crashed"); !strings.Contains(r, ">gone</span>") || strings.Contains(r, ">stopped<") {
		t.Errorf("the crashed instance: %s", r)
	}
}
