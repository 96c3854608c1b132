package web_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/runner"
	"github.com/pgfence/pgfence/web"
)

func get(t *testing.T, u string) (int, http.Header, string) {
	t.Helper()
	res, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, res.Header, string(b)
}

func post(t *testing.T, u string, form url.Values, header map[string]string) (int, string) {
	t.Helper()
	return do(t, http.MethodPost, u, "", header, form)
}

// follow posts form to u and returns the page the 303 it gets sends the
// browser to (relative to base), and that page's status.
func follow(t *testing.T, base, u string, form url.Values, header map[string]string) (int, string) {
	t.Helper()
	res, _ := send(t, http.MethodPost, u, "", header, form)
	if res.StatusCode != http.StatusSeeOther {
		t.Fatalf("POST %s: %d, want 303", u, res.StatusCode)
	}
	code, _, page := get(t, base+"/"+res.Header.Get("Location"))
	return code, page
}

func getJSON(t *testing.T, u string, v any) {
	t.Helper()
	code, h, body := get(t, u)
	if code != http.StatusOK || h.Get("Content-Type") != "application/json" {
		t.Fatalf("GET %s: %d %s\n%s", u, code, h.Get("Content-Type"), body)
	}
	if err := json.Unmarshal([]byte(body), v); err != nil {
		t.Fatalf("GET %s: %v\n%s", u, err, body)
	}
}

// The JSON endpoints serve the CLI's --json shapes, and every page carries
// the strict CSP and reads without JavaScript (the data is in the HTML).
func TestJSONEndpointsAndPages(t *testing.T) {
	t.Parallel()
	rg := newRig(t, web.Config{})
	ctx := pgtest.Context(t, time.Minute)
	l, err := rg.app.Acquire(ctx, "nightly-billing")
	if err != nil {
		t.Fatal(err)
	}
	var leases []map[string]any
	getJSON(t, rg.srv.URL+"/api/leases", &leases)
	i := slices.IndexFunc(leases, func(m map[string]any) bool { return m["name"] == "nightly-billing" })
	if i < 0 || leases[i]["token"] != l.Token().String() || leases[i]["holder"] != "app-1" || leases[i]["expires_in_seconds"].(float64) <= 0 {
		t.Fatalf("api/leases: %v; want nightly-billing held by app-1 with token %s", leases, l.Token())
	}
	pgtest.Eventually(t, 10*time.Second, "a failed attempt of charge in api/runs", func() bool {
		var runs []runner.RunInfo
		getJSON(t, rg.srv.URL+"/api/runs?job=charge&status=failed&limit=5", &runs)
		return len(runs) > 0 && runs[0].Error == failing && runs[0].Job == "charge"
	})
	var jobs []runner.JobInfo
	getJSON(t, rg.srv.URL+"/api/jobs", &jobs)
	if len(jobs) != 3 || jobs[0].Job != "charge" || jobs[0].Leader != "app-1" {
		t.Fatalf("api/jobs: %+v", jobs)
	}
	var fleet struct {
		Instances []runner.InstanceInfo `json:"instances"`
		Terms     []runner.Term         `json:"terms"`
	}
	getJSON(t, rg.srv.URL+"/api/fleet", &fleet)
	if len(fleet.Instances) != 1 || fleet.Instances[0].ID != "app-1" || !fleet.Instances[0].Live || len(fleet.Instances[0].Leads) != 3 || len(fleet.Terms) == 0 {
		t.Fatalf("api/fleet: %+v", fleet)
	}
	var parts []runner.PartitionInfo
	pgtest.Eventually(t, 30*time.Second, "both partitions of relay at offset 3 in api/groups", func() bool {
		getJSON(t, rg.srv.URL+"/api/groups?group=relay", &parts)
		return len(parts) == 2 && parts[0].Offset == 3 && parts[1].Offset == 3 && parts[1].Leader == "app-1"
	})
	var ep migrations.Epoch
	getJSON(t, rg.srv.URL+"/api/epoch", &ep)
	if ep.FirstToken < 1 || ep.Timeline < 1 {
		t.Fatalf("api/epoch: %+v", ep)
	}
	if code, _, body := get(t, rg.srv.URL+"/api/terms?job=charge&group=relay"); code != http.StatusBadRequest {
		t.Fatalf("api/terms with a job and a group: %d %s, want 400", code, body)
	}
	var groupTerms []runner.Term
	getJSON(t, rg.srv.URL+"/api/terms?group=relay", &groupTerms)
	if len(groupTerms) == 0 || groupTerms[0].Group != "relay" || groupTerms[0].Job != "" {
		t.Fatalf("api/terms?group=relay: %+v", groupTerms)
	}
	if code, _, body := get(t, rg.srv.URL+"/api/runs?limit=x"); code != http.StatusBadRequest || !strings.Contains(body, "limit") {
		t.Fatalf("api/runs?limit=x: %d %s", code, body)
	}

	if code, _, body := get(t, rg.srv.URL+"/healthz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("healthz with the database up: %d %q", code, body)
	}
	for _, page := range []struct{ path, want string }{
		{"/", "nightly-billing"},
		{"/jobs", "charge"},
		{"/fleet", "app-1"},
		{"/fleet", "relay</a></th>\n<td class=\"num\">1</td>"}, // the group, then its partition, each in its own cell
		{"/group?name=relay", "Leadership history"},
		{"/jobs?partial=1", "charge"},
	} {
		code, h, body := get(t, rg.srv.URL+page.path)
		csp := h.Get("Content-Security-Policy")
		if code != http.StatusOK || !strings.Contains(body, page.want) || !strings.Contains(csp, "script-src 'self'") ||
			!strings.Contains(csp, "default-src 'none'") || h.Get("X-Content-Type-Options") != "nosniff" {
			t.Fatalf("GET %s: %d, CSP %q\n%s", page.path, code, csp, body)
		}
		if strings.Contains(body, "<script>window.pwned") || strings.Contains(body, "\x1b") {
			t.Fatalf("GET %s: the error text reached the page unescaped:\n%s", page.path, body)
		}
		if partial := strings.Contains(page.path, "partial"); partial == strings.Contains(body, "<html") {
			t.Fatalf("GET %s: partial=%v but the answer is %.80q", page.path, partial, body)
		}
	}
	// Everything the page loads comes from the handler.
	for _, asset := range []string{"/static/app.js", "/static/style.css"} {
		if code, _, body := get(t, rg.srv.URL+asset); code != http.StatusOK || len(body) < 100 {
			t.Fatalf("GET %s: %d, %d bytes", asset, code, len(body))
		}
	}
	_, _, body := get(t, rg.srv.URL+"/")
	if strings.Contains(body, "http://") || strings.Contains(body, "https://") {
		t.Fatalf("the page links outside the handler:\n%s", body)
	}
	if strings.Contains(body, "<form") || strings.Contains(body, "Force release") {
		t.Fatalf("actions are off, but the page offers them:\n%s", body)
	}
}

// Without AllowActions every action is refused with 403 and nothing
// changes.
func TestActionsOffAreRefused(t *testing.T) {
	t.Parallel()
	rg := newRig(t, web.Config{})
	ctx := pgtest.Context(t, time.Minute)
	l, err := rg.app.Acquire(ctx, "keep-me")
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, 10*time.Second, "the runner to register its jobs", func() bool {
		jobs, err := runner.Jobs(ctx, rg.db.Pool, rg.db.Schema, "")
		return err == nil && len(jobs) == 3
	})
	for _, a := range []struct {
		path string
		form url.Values
	}{
		{"/run", url.Values{"job": {"tick"}}},
		{"/pause", url.Values{"job": {"tick"}}},
		{"/resume", url.Values{"job": {"tick"}}},
		{"/release", url.Values{"name": {"keep-me"}, "token": {l.Token().String()}}},
	} {
		if code, body := post(t, rg.srv.URL+a.path, a.form, nil); code != http.StatusForbidden || !strings.Contains(body, "actions are disabled") {
			t.Fatalf("POST %s: %d\n%s", a.path, code, body)
		}
	}
	if code, _, _ := get(t, rg.srv.URL+"/release?name=keep-me"); code != http.StatusForbidden {
		t.Fatalf("GET /release with actions off: %d, want 403", code)
	}
	if err := l.Check(ctx); err != nil {
		t.Fatalf("the lease after a refused release: %v", err)
	}
	if runs, err := runner.Runs(ctx, rg.db.Pool, rg.db.Schema, runner.RunFilter{Job: "tick", Limit: 100}); err != nil ||
		slices.ContainsFunc(runs, func(r runner.RunInfo) bool { return r.Kind == runner.KindManual }) {
		t.Fatalf("a manual run after a refused run now: %v", err)
	}
	if jobs, _ := runner.Jobs(ctx, rg.db.Pool, rg.db.Schema, "tick"); len(jobs) != 1 || jobs[0].Paused {
		t.Fatalf("tick after a refused pause: %+v", jobs)
	}
}

// With actions on, a cross-origin browser POST is refused (CSRF); a
// same-origin one runs the job, pauses and resumes it and force-releases a
// lease (only with the token its confirmation showed), each logged with who
// asked.
func TestActionsAreSameOriginAndLogged(t *testing.T) {
	t.Parallel()
	rg := newRig(t, web.Config{AllowActions: true, Identity: func(r *http.Request) string { return r.Header.Get("X-User") }})
	ctx := pgtest.Context(t, time.Minute)
	pgtest.Eventually(t, 10*time.Second, "the runner to register its jobs", func() bool {
		jobs, err := runner.Jobs(ctx, rg.db.Pool, rg.db.Schema, "")
		return err == nil && len(jobs) == 3
	})
	form := url.Values{"job": {"tick"}}
	for _, h := range []map[string]string{
		{"Sec-Fetch-Site": "cross-site"},
		{"Origin": "http://evil.example"},
	} {
		if code, _ := post(t, rg.srv.URL+"/run", form, h); code != http.StatusForbidden {
			t.Fatalf("cross-origin POST with %v: %d, want 403", h, code)
		}
	}
	manual := func() []runner.RunInfo {
		runs, err := runner.Runs(ctx, rg.db.Pool, rg.db.Schema, runner.RunFilter{Job: "tick", Limit: 100})
		if err != nil {
			t.Fatal(err)
		}
		return slices.DeleteFunc(runs, func(r runner.RunInfo) bool { return r.Kind != runner.KindManual })
	}
	if n := len(manual()); n != 0 {
		t.Fatalf("%d manual runs after cross-origin POSTs", n)
	}
	code, page := follow(t, rg.srv.URL, rg.srv.URL+"/run", form, map[string]string{"Sec-Fetch-Site": "same-origin", "X-User": "alice"})
	if code != http.StatusOK || !strings.Contains(page, "Asked for a run of tick (") {
		t.Fatalf("same-origin run now: %d, no notice of the run:\n%s", code, page)
	}
	pgtest.Eventually(t, 10*time.Second, "the manual run to succeed", func() bool {
		m := manual()
		return len(m) == 1 && m[0].Status == runner.StatusSucceeded
	})
	if m := manual(); m[0].RequestedBy != "pgfence-web:alice" {
		t.Fatalf("requested_by %q, want pgfence-web:alice", m[0].RequestedBy)
	}
	// Each action leads to a page that says what it did, read from the
	// database.
	if code, page := follow(t, rg.srv.URL, rg.srv.URL+"/pause", form, nil); code != http.StatusOK || !strings.Contains(page, "tick is paused (by pgfence-web:127.0.0.1:") {
		t.Fatalf("after pause: %d, no notice of the pause:\n%s", code, page)
	}
	if jobs, _ := runner.Jobs(ctx, rg.db.Pool, rg.db.Schema, "tick"); len(jobs) != 1 || !jobs[0].Paused || !strings.HasPrefix(jobs[0].PausedBy, "pgfence-web:127.0.0.1:") {
		t.Fatalf("after pause: %+v", jobs)
	}
	if code, page := follow(t, rg.srv.URL, rg.srv.URL+"/resume", form, nil); code != http.StatusOK || !strings.Contains(page, "tick is not paused") {
		t.Fatalf("after resume: %d, no notice:\n%s", code, page)
	}
	// A link made up to claim a pause says what is true.
	if _, _, page := get(t, rg.srv.URL+"/job?name=tick&done=pause"); strings.Contains(page, "tick is paused") {
		t.Fatal("a made-up link made the page claim a pause")
	}
	if code, body := post(t, rg.srv.URL+"/run", url.Values{"job": {"no-such-job"}}, nil); code != http.StatusNotFound || !strings.Contains(body, "unknown job") {
		t.Fatalf("run now of an unknown job: %d\n%s", code, body)
	}

	// Force release: the confirmation names holder and token; a POST with
	// another token releases nothing.
	l, err := rg.app.Acquire(ctx, "stuck")
	if err != nil {
		t.Fatal(err)
	}
	_, _, page = get(t, rg.srv.URL+"/release?name=stuck")
	if !strings.Contains(page, "held by <strong>app-1</strong> with token "+l.Token().String()) || !strings.Contains(page, "will be refused") {
		t.Fatalf("confirmation page:\n%s", page)
	}
	stale := url.Values{"name": {"stuck"}, "token": {(l.Token() - 1).String()}}
	if code, body := post(t, rg.srv.URL+"/release", stale, nil); code != http.StatusConflict || !strings.Contains(body, "nothing released") {
		t.Fatalf("release with a token other than the lease's: %d\n%s", code, body)
	}
	if err := l.Check(ctx); err != nil {
		t.Fatalf("the lease after a refused release: %v", err)
	}
	ok := url.Values{"name": {"stuck"}, "token": {l.Token().String()}}
	if code, page := follow(t, rg.srv.URL, rg.srv.URL+"/release", ok, map[string]string{"X-User": "bob"}); code != http.StatusOK ||
		!strings.Contains(page, "Released lease stuck: writes with token "+l.Token().String()+" are refused") {
		t.Fatalf("after release: %d, no notice:\n%s", code, page)
	}
	select {
	case <-l.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the holder's lease did not end after the force release")
	}
	if !errors.Is(l.Err(), lock.ErrLeaseLost) {
		t.Fatalf("the holder's lease ended with %v, want ErrLeaseLost", l.Err())
	}
	logged := map[string]string{}
	for _, r := range rg.logs.Find(slog.LevelInfo, "pgfence web: action") {
		var action, remote, identity string
		r.Attrs(func(a slog.Attr) bool {
			switch a.Key {
			case "action":
				action = a.Value.String()
			case "remote_addr":
				remote = a.Value.String()
			case "identity":
				identity = a.Value.String()
			}
			return true
		})
		if !strings.HasPrefix(remote, "127.0.0.1:") {
			t.Fatalf("action %s logged without the remote address: %q", action, remote)
		}
		logged[action] = identity
	}
	if want := map[string]string{"run": "alice", "pause": "", "resume": "", "release": "bob"}; !mapsEqual(logged, want) {
		t.Fatalf("logged actions (action: identity) %v, want %v", logged, want)
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// The pages and JSON need nothing more than GrantOperator, and so do the
// actions.
func TestOperatorRoleIsEnough(t *testing.T) {
	t.Parallel()
	rg := newRig(t, web.Config{})
	ctx := pgtest.Context(t, time.Minute)
	role := strings.ReplaceAll(pgtest.UniqueName("pgfence_web_op"), "-", "_")
	if _, err := rg.db.Pool.Exec(ctx, "CREATE ROLE "+role+" LOGIN NOSUPERUSER"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = rg.db.Pool.Exec(context.Background(), "DROP OWNED BY "+role+"; DROP ROLE "+role) })
	if err := migrations.GrantOperator(ctx, rg.db.Pool, rg.db.Schema, role); err != nil {
		t.Fatal(err)
	}
	op := pgtest.NewPool(t, "web-operator", func(c *pgxpool.Config) { c.ConnConfig.User = role })
	oc, err := lock.New(op, lock.Config{Schema: rg.db.Schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = oc.Close(context.Background()) })
	h, err := web.New(oc.Pool(), web.Config{Schema: oc.Config().Schema, AllowActions: true, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptestServer(t, h)
	if _, err := rg.app.Acquire(ctx, "held"); err != nil {
		t.Fatal(err)
	}
	pgtest.Eventually(t, 10*time.Second, "a run in the ledger", func() bool {
		runs, err := runner.Runs(ctx, rg.db.Pool, rg.db.Schema, runner.RunFilter{})
		return err == nil && len(runs) > 0
	})
	for _, p := range []string{"/", "/jobs", "/fleet", "/api/leases", "/api/jobs", "/api/runs", "/api/fleet", "/api/groups", "/api/terms", "/group?name=relay", "/api/epoch", "/release?name=held"} {
		if code, _, body := get(t, srv+p); code != http.StatusOK {
			t.Fatalf("GET %s as the operator role: %d\n%s", p, code, body)
		}
	}
	if code, body := post(t, srv+"/pause", url.Values{"job": {"tick"}}, nil); code != http.StatusSeeOther {
		t.Fatalf("pause as the operator role: %d\n%s", code, body)
	}
}

// New refuses bad configurations with a typed error.
func TestNewRefusesBadConfig(t *testing.T) {
	if _, err := web.New(nil, web.Config{}); !errors.Is(err, web.ErrNilPool) {
		t.Fatalf("New(nil): %v", err)
	}
	db := pgtest.New(t)
	for _, cfg := range []web.Config{{Refresh: time.Millisecond}, {Attempts: -1}, {Attempts: 5000}, {Schema: "bad\x00schema"}} {
		if _, err := web.New(db.Pool, cfg); !errors.Is(err, web.ErrInvalidConfig) {
			t.Fatalf("New(%+v): %v, want ErrInvalidConfig", cfg, err)
		}
	}
}

// Mounted under a prefix, the page links and redirects relative to it, and
// the prefix without its slash is redirected to it.
func TestMountedUnderAPrefix(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	h, err := web.New(db.Pool, web.Config{Schema: db.Schema, AllowActions: true, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/pgfence/", http.StripPrefix("/ops/pgfence", h))
	srv := httptestServer(t, mux)
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err := c.Get(srv + "/ops/pgfence")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if loc := res.Header.Get("Location"); res.StatusCode/100 != 3 || !strings.HasSuffix(loc, "pgfence/") {
		t.Fatalf("GET /ops/pgfence: %d to %q, want a redirect to pgfence/", res.StatusCode, loc)
	}
	// A router that passes the prefix without its slash on (StripPrefix
	// leaves an empty path): the handler redirects itself.
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/ops/pgfence", nil)
	req.Host = "localhost" // httptest's example.com is not a name the page serves
	http.StripPrefix("/ops/pgfence", h).ServeHTTP(rec, req)
	if loc := rec.Header().Get("Location"); rec.Code != http.StatusMovedPermanently || loc != "pgfence/" {
		t.Fatalf("the handler asked for an empty path: %d to %q, want 301 to pgfence/", rec.Code, loc)
	}
	code, _, body := get(t, srv+"/ops/pgfence/jobs")
	if code != http.StatusOK || !strings.Contains(body, `href="static/style.css"`) || !strings.Contains(body, `href="fleet"`) || strings.Contains(body, `href="/`) {
		t.Fatalf("GET /ops/pgfence/jobs: %d; want only links relative to the mount point\n%s", code, body)
	}
	if code, _, _ := get(t, srv+"/ops/pgfence/static/app.js"); code != http.StatusOK {
		t.Fatalf("GET /ops/pgfence/static/app.js: %d", code)
	}
	req, _ = http.NewRequest(http.MethodPost, srv+"/ops/pgfence/resume", strings.NewReader("job=nope"))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	res, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusNotFound {
		t.Fatalf("POST resume of an unknown job under the prefix: %d, want 404", res.StatusCode)
	}
}

// healthz answers 503 with the error when the database does not answer (a
// pool to a port nothing listens on).
func TestHealthzWithoutTheDatabase(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/none?sslmode=disable&connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	h, err := web.New(pool, web.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptestServer(t, h)
	if code, _, body := get(t, srv+"/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "the database does not answer") {
		t.Fatalf("healthz with no database: %d %q", code, body)
	}
}

// A request whose database stops answering (a partition that black-holes
// packets) fails within its 15 s bound, so that an open page says it is
// not updating, instead of waiting for TCP to give up.
func TestReadsFailWhenTheDatabaseStopsAnswering(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	proxy, err := faultproxy.To(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	pool := pgtest.NewPool(t, pgtest.UniqueName("web-cut"), func(c *pgxpool.Config) { proxy.Route(&c.ConnConfig.Config) })
	// Registered after the pool's, so it runs first: the pool closes its
	// cut connections at once.
	t.Cleanup(func() { _ = proxy.Close() })
	h, err := web.New(pool, web.Config{Schema: db.Schema, Logger: pgtest.Quiet})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	if code, _, body := get(t, srv.URL+"/api/leases"); code != http.StatusOK {
		t.Fatalf("GET api/leases before the cut: %d %s", code, body)
	}
	proxy.Set(faultproxy.Blackhole)
	began := time.Now()
	client := &http.Client{Timeout: time.Minute}
	res, err := client.Get(srv.URL + "/api/leases")
	if err != nil {
		t.Fatalf("GET api/leases during the cut: %v (the server did not answer within a minute)", err)
	}
	res.Body.Close()
	took := time.Since(began)
	if res.StatusCode == http.StatusOK {
		t.Fatal("GET api/leases answered 200 while its database did not answer")
	}
	if took > 20*time.Second {
		t.Fatalf("GET api/leases failed after %v, past its 15 s bound", took)
	}
	t.Logf("GET api/leases during the cut: %d after %v", res.StatusCode, took.Round(time.Millisecond))
}
