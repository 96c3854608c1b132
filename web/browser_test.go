package web_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/runner"
	"github.com/pgfence/pgfence/web"
)

// refresh is the pages' update interval in the browser test.
const refresh = 500 * time.Millisecond

// withinRefresh bounds a wait for the page to show a change: one refresh,
// plus the round trip and the rendering on a loaded machine.
const withinRefresh = refresh + 2*time.Second

// browser starts headless Chromium (Debian's chromium) and returns a
// context to drive it. A test without Chromium skips, naming the package
// to install, and fails with CI=true. Console errors and exceptions (a
// script the CSP blocked, a script error) fail the test.
func browser(t *testing.T) (context.Context, *console) {
	t.Helper()
	path := os.Getenv("PGFENCE_CHROMIUM")
	if path == "" {
		for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
			if p, err := exec.LookPath(name); err == nil {
				path = p
				break
			}
		}
	}
	if path == "" {
		pgtest.NeedTool(t, fmt.Errorf("the browser tests need Chromium on PATH (Debian: apt-get install chromium; or set PGFENCE_CHROMIUM): %w", exec.ErrNotFound), exec.ErrNotFound)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.WindowSize(1400, 900),
		chromedp.Flag("disable-dev-shm-usage", true))
	if os.Geteuid() == 0 {
		opts = append(opts, chromedp.NoSandbox) // Chromium's sandbox refuses to run as root
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	ctx, cancelTimeout := context.WithTimeout(ctx, 3*time.Minute)
	if err := chromedp.Do(ctx, chromedp.Navigate("about:blank")); err != nil {
		cancelTimeout()
		cancel()
		cancelAlloc()
		t.Fatalf("start Chromium (%s): %v", path, err)
	}
	con := &console{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m, err := range chromedp.Console(ctx) {
			if err != nil {
				return
			}
			if m.IsException() || m.Type == "error" {
				con.add(m.String())
			}
		}
	}()
	t.Cleanup(func() {
		cancelTimeout()
		cancel()
		cancelAlloc()
		<-done
		for _, p := range con.unexpected() {
			t.Errorf("the page's console: %s", p)
		}
	})
	return ctx, con
}

// console keeps the errors the page wrote to its console.
type console struct {
	mu       sync.Mutex
	problems []string
	expected []string
}

func (c *console) add(msg string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.problems = append(c.problems, msg)
}

// expect makes one error containing text expected (a request the test
// makes fail on purpose).
func (c *console) expect(text string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.expected = append(c.expected, text)
}

func (c *console) unexpected() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	exp := slices.Clone(c.expected)
	for _, p := range c.problems {
		if i := slices.IndexFunc(exp, func(e string) bool { return strings.Contains(p, e) }); i >= 0 {
			exp = slices.Delete(exp, i, i+1)
			continue
		}
		out = append(out, p)
	}
	return out
}

// screenshots is the directory the browser test writes its screenshots to:
// PGFENCE_SCREENSHOTS, else pgfence-screenshots in the temporary directory.
func screenshots(t *testing.T) string {
	dir := os.Getenv("PGFENCE_SCREENSHOTS")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "pgfence-screenshots")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshots in %s", dir)
	return dir
}

func shoot(dir, name string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
		buf, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dir, name+".png"), buf, 0o644)
	})
}

// until waits for the JavaScript expression cond to be true on the page.
func until(cond string, d time.Duration) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
		_, err := chromedp.Run(ctx, chromedp.Poll[bool](cond, chromedp.WithPollingTimeout(d), chromedp.WithPollingInterval(50*time.Millisecond)))
		if err != nil {
			return fmt.Errorf("waiting %v for %s: %w", d, cond, err)
		}
		return nil
	})
}

// check fails with what if the JavaScript expression cond is not true.
func check(cond, what string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
		ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](cond))
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		if !ok {
			return errors.New(what)
		}
		return nil
	})
}

// eval sets *v to the value of the JavaScript expression expr.
func eval[T any](expr string, v *T, opts ...chromedp.EvaluateOption) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, _ *chromedp.Target) (err error) {
		*v, err = chromedp.Run(ctx, chromedp.Evaluate[T](expr, opts...))
		return err
	})
}

// The status page in a real browser, against a live schema and a running
// runner: a lease acquired while the page is open appears within one
// refresh, without a reload, and its countdown runs; a failed attempt's
// error shows; a hostile lease name and error text are shown as text; a
// focused button keeps the focus across updates; "run now" runs the job
// once and the page shows it; force release asks first; with actions
// disabled there are no buttons and a POST gets 403.
func TestStatusPageInBrowser(t *testing.T) {
	ctx, con := browser(t)
	dir := screenshots(t)
	rg := newRig(t, web.Config{AllowActions: true, Refresh: refresh, Attempts: 5}) // billing's 7 attempts take two pages
	dbctx := pgtest.Context(t, 3*time.Minute)
	base := rg.srv.URL + "/"
	const hostile = "<img src=x onerror=\"window.pwned=1\">\x1b[2J\u202eesael"

	// The leases page: the hostile lease, acquired once the page is open,
	// appears by the next refresh, as text.
	err := chromedp.Do(ctx,
		chromedp.Navigate(base),
		chromedp.WaitVisible(chromedp.CSS("#leases")),
		chromedp.Evaluate[chromedp.Void](`window.marker = "same page"`),
	)
	if err != nil {
		t.Fatal(err)
	}
	lease, err := rg.app.Acquire(dbctx, hostile)
	if err != nil {
		t.Fatal(err)
	}
	err = chromedp.Do(ctx,
		until(`[...document.querySelectorAll("#leases th.name")].some(e => e.textContent.startsWith("\"<img src=x"))`, withinRefresh),
		check(`window.marker === "same page"`, "the page reloaded instead of updating in place"),
		check(`window.pwned === undefined && document.querySelector("#leases img") === null`, "the lease name was interpreted as HTML"),
		check(`[...document.querySelectorAll("#leases th.name")].some(e => e.textContent.includes("\\x1b[2J\\u202eesael"))`,
			"the control and bidi characters of the lease name are not shown escaped"),
	)
	if err != nil {
		t.Fatal(err)
	}
	// Two holders that stopped renewing (rows as a frozen holder leaves
	// them): one expired and not released, one with a renewal overdue.
	leases := pgx.Identifier{rg.db.Schema, "pgfence_leases"}.Sanitize()
	sessions := pgx.Identifier{rg.db.Schema, "pgfence_sessions"}.Sanitize()
	if _, err := rg.db.Pool.Exec(dbctx, `WITH s AS (INSERT INTO `+sessions+` (holder, started_at, renewed_at, expires_at) VALUES
		('worker-7', now() - interval '2 hours', now() - interval '20 seconds', now() - interval '5 seconds'),
		('worker-3', now() - interval '1 minute', now() - interval '100 seconds', now() + interval '30 seconds') RETURNING id, holder)
		INSERT INTO `+leases+` (name, holder, secret, session, acquired_at)
		SELECT CASE s.holder WHEN 'worker-7' THEN 'compact-events' ELSE 'reports/daily' END, s.holder,
		       CASE s.holder WHEN 'worker-7' THEN '\x01'::bytea ELSE '\x02'::bytea END, s.id,
		       CASE s.holder WHEN 'worker-7' THEN now() - interval '2 hours' ELSE now() - interval '1 minute' END
		  FROM s`); err != nil {
		t.Fatal(err)
	}
	err = chromedp.Do(ctx,
		until(`document.querySelector('#leases tr.st-expired[data-lease="compact-events"]') !== null`, withinRefresh),
		check(`document.querySelector('#leases tr.st-expired[data-lease="compact-events"]').textContent.includes("expired, not released")`,
			"the expired lease is not marked as expired and not released"),
		check(`document.querySelector('#leases tr.st-ending[data-lease="reports/daily"]').textContent.includes("renewal overdue")`,
			"the lease whose renewal is overdue is not marked"),
		until(`document.querySelector('#runner-leases tr.st-held[data-lease="pgfence/job/tick"]')?.textContent.includes("held")`, withinRefresh),
	)
	if err != nil {
		t.Fatal(err)
	}
	var before, after string
	// The lease nobody renews counts down (in whole seconds above 10 s).
	countdown := `document.querySelector('#leases tr[data-lease="reports/daily"] .countdown').textContent`
	err = chromedp.Do(ctx,
		eval(countdown, &before),
		chromedp.Sleep(1200*time.Millisecond),
		eval(countdown, &after),
		shoot(dir, "status-leases"),
	)
	if err != nil {
		t.Fatal(err)
	}
	if before == after {
		t.Fatalf("the expiry countdown did not move: %q then %q", before, after)
	}

	// The jobs page: the failed attempt's error, as text.
	err = chromedp.Do(ctx,
		chromedp.Navigate(base+"jobs"),
		until(`document.querySelector('#runs tr.bad[data-status="failed"] .error') !== null`, withinRefresh),
		until(`[...document.querySelectorAll('#runs tr[data-status="failed"] .error')].some(e => e.textContent.includes("<script>window.pwned = true</script><b>boom</b>\\x1b[31m \\u202eevil"))`,
			withinRefresh),
		check(`window.pwned === undefined && document.querySelectorAll("#live script, #live b").length === 0`, "the error text was interpreted as HTML"),
		// Its row stands out while its last attempt is a failure (not while
		// the next attempt runs).
		until(`document.querySelector('#jobs tr[data-job="charge"]').classList.contains("bad")`, withinRefresh),
		shoot(dir, "status-jobs"),
	)
	if err != nil {
		t.Fatal(err)
	}

	// Keyboard: a focused button keeps the focus while the page updates.
	runButton := `#jobs tr[data-job="tick"] form[action="run"] button`
	err = chromedp.Do(ctx,
		chromedp.Focus(chromedp.CSS(runButton)),
		chromedp.Evaluate[chromedp.Void](`document.body.dataset.stamp = document.getElementById("stamp").textContent`),
		until(`document.getElementById("stamp").textContent !== document.body.dataset.stamp`, withinRefresh),
		check(`document.activeElement === document.querySelector('`+runButton+`')`, "the focus was lost when the page updated"),
	)
	if err != nil {
		t.Fatal(err)
	}

	// Run now: one manual run of tick, shown on the page.
	err = chromedp.Do(ctx,
		chromedp.Click(chromedp.CSS(runButton)),
		chromedp.WaitVisible(chromedp.CSS(`#notice`)), // tick's page, where the click leads, says what became of the run
		until(`document.querySelector('#notice').textContent.startsWith("Asked for a run of tick") && document.querySelector('#notice').textContent.includes("succeeded")`, 10*time.Second),
		until(`document.querySelector('#runs tr[data-kind="manual"][data-status="succeeded"]') !== null`, 10*time.Second),
	)
	if err != nil {
		t.Fatal(err)
	}
	runs, err := runner.Runs(dbctx, rg.db.Pool, rg.db.Schema, runner.RunFilter{Job: "tick", Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	manual := slices.DeleteFunc(runs, func(r runner.RunInfo) bool { return r.Kind != runner.KindManual })
	if len(manual) != 1 || manual[0].Status != runner.StatusSucceeded || !strings.HasPrefix(manual[0].RequestedBy, "pgfence-web:") {
		t.Fatalf("manual runs of tick after one click: %+v; want one, succeeded", manual)
	}

	// The fleet page: a replica that stopped cleanly is told from one
	// that went without a word.
	if _, err := rg.db.Pool.Exec(dbctx, `INSERT INTO `+pgx.Identifier{rg.db.Schema, "pgfence_instances"}.Sanitize()+
		` (id, started_at, heartbeat_at, expires_at, stopped_at) VALUES
		('web-stopped', now() - interval '1 hour', now() - interval '1 minute', now() - interval '1 minute', now() - interval '1 minute'),
		('web-crashed', now() - interval '1 hour', now() - interval '1 minute', now() - interval '30 seconds', NULL)`); err != nil {
		t.Fatal(err)
	}
	row := func(id string) string {
		return `[...document.querySelectorAll("#instances tr")].find(r => r.querySelector("th")?.textContent === "` + id + `")?.querySelector(".badge")?.textContent`
	}
	err = chromedp.Do(ctx,
		chromedp.Navigate(base+"fleet"),
		until(row("web-stopped")+` === "stopped" && `+row("web-crashed")+` === "gone"`, withinRefresh),
		until(`[...document.querySelectorAll("#instances th.name")].some(e => e.textContent === "app-1")`, withinRefresh),
		until(`document.querySelectorAll("#terms tbody tr th").length > 0`, withinRefresh),
		// The partitions table's columns line up: as many cells as headers
		// in every row (the group and its partition had shared one).
		until(`document.querySelectorAll("#partitions tbody tr th.name").length >= 2`, withinRefresh),
		// The instance leading the group's two partitions says so, and
		// counts them apart from its jobs.
		until(`document.querySelector('#instances tr[data-instance="app-1"] .partition-count')?.textContent === "2 partition(s)"`, withinRefresh),
		check(`document.querySelector('#instances tr[data-instance="app-1"] .registered').textContent.endsWith("1 consumer group(s)")`,
			"the fleet page counts the consumer group as a job"),
		check(`[...document.querySelectorAll("#partitions tbody tr")].every(r => r.children.length === document.querySelectorAll("#partitions thead th").length)`,
			"a row of the partitions table has not as many cells as it has headers"),
		// Each partition's lag behind the end offset its group reports: 5 - 3.
		until(`[...document.querySelectorAll("#partitions tbody td.lag")].every(e => e.textContent.startsWith("2 "))`, withinRefresh),
		shoot(dir, "status-fleet"),
	)
	if err != nil {
		t.Fatal(err)
	}

	// The consumer group's page, reached from the fleet page: its
	// partitions (columns lined up, lag), its leadership history with
	// why each term ended, and a fenced seek from its form: partition 0
	// back to offset 1, its term revoked, its lag now 5 - 1.
	cells := func(table string) string {
		return `[...document.querySelectorAll("` + table + ` tbody tr")].every(r => r.children.length === document.querySelectorAll("` + table + ` thead th").length)`
	}
	err = chromedp.Do(ctx,
		chromedp.Navigate(base+"fleet"),
		chromedp.WaitVisible(chromedp.CSS(`#partitions tbody tr th.name a`)),
		chromedp.Click(chromedp.CSS(`#partitions tbody tr th.name a`)),
		chromedp.WaitVisible(chromedp.CSS(`#group-terms`)),
		until(`document.querySelectorAll("#group-terms tbody tr[data-partition]").length >= 2`, withinRefresh),
		check(cells("#partitions"), "a row of the group's partitions table has not as many cells as it has headers"),
		check(cells("#group-terms"), "a row of the group's history has not as many cells as it has headers"),
		until(`[...document.querySelectorAll("#partitions tbody td.lag")].every(e => e.textContent.startsWith("2 "))`, withinRefresh),
		chromedp.SetValue(chromedp.CSS(`#seek-partition`), "0"),
		chromedp.SetValue(chromedp.CSS(`#seek-offset`), "1"),
		chromedp.Click(chromedp.CSS(`#seek-apply`)),
		chromedp.WaitVisible(chromedp.CSS(`#notice`)),
		until(`document.querySelector('#notice')?.textContent.startsWith("Partition 0 sought from offset 3 to 1")`, 10*time.Second),
		until(`[...document.querySelectorAll('#group-terms tr[data-partition="0"] td.why')].some(e => e.textContent.startsWith("revoked"))`, withinRefresh),
		until(`document.querySelector('#partitions tr[data-partition="0"] td.offset')?.textContent === "1"`, withinRefresh),
		until(`document.querySelector('#partitions tr[data-partition="0"] td.lag')?.textContent.startsWith("4 ")`, withinRefresh),
		check(cells("#group-terms"), "a row of the group's history has not as many cells as it has headers"),
		shoot(dir, "status-group"),
	)
	if err != nil {
		t.Fatal(err)
	}

	// A job's page, reached from its name on the jobs page: both timelines
	// drawn (the term leading now, failed attempts), the attempts
	// filtered by status with the form.
	err = chromedp.Do(ctx,
		chromedp.Navigate(base+"jobs"),
		chromedp.WaitVisible(chromedp.CSS(`#jobs tr[data-job="charge"] th a`)),
		chromedp.Click(chromedp.CSS(`#jobs tr[data-job="charge"] th a`)),
		chromedp.WaitVisible(chromedp.CSS("#job-facts")),
		check(`document.querySelector("#job-facts").textContent.includes("every 300ms")`, "the job page does not say the schedule"),
		until(`document.querySelector('#live svg.chart g.term-current[class~="term"]') !== null`, withinRefresh),
		check(`document.querySelector('#live svg.chart').getBoundingClientRect().height > 20`, "the leadership timeline is not drawn"),
		check(`document.querySelector('#live svg.chart g.term-current title').textContent.includes("held by app-1")`,
			"the current term's bar does not name its holder"),
		until(`document.querySelectorAll('#live svg.chart g.run-failed').length > 0`, withinRefresh),
		shoot(dir, "status-job"),
		chromedp.SetValue(chromedp.CSS("#filter-status"), "failed"),
		chromedp.Click(chromedp.CSS("#filter-apply")),
		chromedp.WaitVisible(chromedp.CSS(`#runs tr[data-status="failed"]`)),
		chromedp.WaitReady(chromedp.CSS(`#filter-status option[value="failed"][selected]`)), // the filtered page
		check(`location.search.includes("status=failed")`, "the filter form did not ask for failed attempts"),
		check(`[...document.querySelectorAll("#runs tbody tr[data-status]")].every(r => r.dataset.status === "failed")`,
			"the status filter did not leave only failed attempts"),
	)
	if err != nil {
		t.Fatal(err)
	}

	// A job with a known history of terms: its page is README's picture.
	seedHistory(t, rg.db)
	err = chromedp.Do(ctx,
		chromedp.Navigate(base+"job?name=billing"),
		chromedp.WaitVisible(chromedp.CSS("#job-facts")),
		check(`document.querySelectorAll('#live svg.chart g.term').length === 3 && document.querySelectorAll('#live svg.chart g.fenced-mark').length === 1`,
			"the leadership timeline does not draw the three terms and the fenced attempt"),
		check(`[...document.querySelectorAll('#live svg.chart g.term title')].map(t => t.textContent.match(/held by (n\d)/)[1]).join() === "n1,n2,n3"`,
			"the terms are not n1's, n2's and n3's, in that order"),
		check(`document.querySelector('#shards span.warn')?.textContent === "4"`, "the job page does not count 4 failures in a row"),
		shoot(dir, "job-page"),
		// Paging: the older attempts, then back.
		chromedp.Click(chromedp.CSS("#page-older")),
		chromedp.WaitVisible(chromedp.CSS("#page-newer")),
		check(`document.querySelectorAll("#runs tbody tr[data-status]").length === 2 && document.querySelector("#page-older") === null`,
			"the second page of billing's attempts does not hold the last two"),
		chromedp.Click(chromedp.CSS("#page-newer")),
		chromedp.WaitVisible(chromedp.CSS("#page-older")),
		check(`document.querySelectorAll("#runs tbody tr[data-status]").length === 5`, "the first page does not hold five attempts"),
	)
	if err != nil {
		t.Fatal(err)
	}

	con.expect("status of 404") // the error page below
	// Force release: the confirmation first, then the lease is free and
	// its holder's lease ends.
	err = chromedp.Do(ctx,
		chromedp.Navigate(base),
		chromedp.WaitVisible(chromedp.CSS("#leases")),
		chromedp.Click(chromedp.CSS(`#leases tr.st-held a.button`)), // the first held lease by name: the hostile one
		chromedp.WaitVisible(chromedp.CSS("#confirm-release")),
		check(`document.querySelector("main").textContent.includes("will be refused")`, "the confirmation does not say what releasing does"),
		shoot(dir, "status-release"),
		chromedp.Click(chromedp.CSS("#confirm-release")),
		chromedp.WaitVisible(chromedp.CSS("#notice")),
		check(`document.querySelector("#notice").textContent.startsWith("Released lease")`, "the leases page does not confirm the release"),
		until(`document.querySelector("#leases tr.st-free") !== null`, withinRefresh),
		// Held (and expired, not released) leases first; no history column
		// where every token is of the current history.
		check(`document.querySelector("#leases tbody tr:last-child").classList.contains("st-free")`, "a free lease is listed before held ones"),
		check(`![...document.querySelectorAll("th")].some(th => th.textContent === "Issued in")`, "the history column is shown with nothing to say"),
		// Names wrap at word boundaries, not mid-word.
		check(`getComputedStyle(document.querySelector("#leases th.name")).overflowWrap === "break-word"`, "names may break mid-word"),
		// An error page's text reads as written.
		chromedp.Navigate(base+"job?name=no-such-job"),
		chromedp.WaitVisible(chromedp.CSS(".failure")),
		check(`document.querySelector(".failure").textContent.startsWith('no job named "no-such-job"')`, "the error text is not shown as text"),
	)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-lease.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the holder's lease did not end after the force release")
	}
	if !errors.Is(lease.Err(), lock.ErrLeaseLost) {
		t.Fatalf("the holder's lease ended with %v, want ErrLeaseLost", lease.Err())
	}

	// Actions disabled: no buttons, and the browser's POST gets 403.
	h, err := web.New(rg.db.Pool, web.Config{Schema: rg.db.Schema, Refresh: refresh})
	if err != nil {
		t.Fatal(err)
	}
	ro := httptest.NewServer(h)
	t.Cleanup(ro.Close)
	var status int
	con.expect("status of 403")
	err = chromedp.Do(ctx,
		chromedp.Navigate(ro.URL+"/jobs"),
		chromedp.WaitVisible(chromedp.CSS("#jobs")),
		check(`document.querySelectorAll("form, button, a.button").length === 0`, "the read-only page shows actions"),
		eval(`fetch("run", {method: "POST", body: new URLSearchParams({job: "tick"})}).then(r => r.status)`, &status, chromedp.EvalAwaitPromise),
	)
	if err != nil {
		t.Fatal(err)
	}
	if status != http.StatusForbidden {
		t.Fatalf("POST run from the read-only page: %d, want 403", status)
	}
}
