package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/faultproxy"
	"github.com/pgfence/pgfence/internal/pgtest"
)

// pgfence ui serves the status page on localhost, read-only unless
// --allow-actions, and stops cleanly on SIGINT.
func TestUIServesTheStatusPage(t *testing.T) {
	c := newCLI(t)
	if out, code := c.run("", "run", "--lease", "nightly", "--", "true"); code != 0 {
		t.Fatalf("run: %d %s", code, out)
	}
	cliOut, code := c.run("", "leases", "--json")
	var cliLeases []map[string]any
	if err := json.Unmarshal([]byte(cliOut), &cliLeases); code != 0 || err != nil || len(cliLeases) != 1 {
		t.Fatalf("leases --json: %d %v\n%s", code, err, cliOut)
	}
	for _, allow := range []bool{false, true} {
		args := []string{"ui", "--listen", "127.0.0.1:0"}
		if allow {
			args = append(args, "--allow-actions")
		}
		cmd := c.cmd("", args...)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		line, err := bufio.NewReader(out).ReadString('\n')
		if err != nil {
			_ = cmd.Process.Kill()
			t.Fatalf("pgfence ui printed no address: %v", err)
		}
		m := regexp.MustCompile(`http://(127\.0\.0\.1:\d+)/`).FindStringSubmatch(line)
		if m == nil {
			_ = cmd.Process.Kill()
			t.Fatalf("pgfence ui: %q names no localhost URL", line)
		}
		base := "http://" + m[1] + "/"
		res, err := http.Get(base + "api/leases")
		if err != nil {
			t.Fatal(err)
		}
		var leases []map[string]any
		err = json.NewDecoder(res.Body).Decode(&leases)
		res.Body.Close()
		if err != nil || res.StatusCode != http.StatusOK || len(leases) != 1 {
			t.Fatalf("GET api/leases: %d, %v, %v", res.StatusCode, err, leases)
		}
		if got, want := keys(leases[0]), keys(cliLeases[0]); got != want || leases[0]["token"] != cliLeases[0]["token"] {
			t.Fatalf("api/leases has the keys %s (token %v), leases --json %s (token %v)", got, leases[0]["token"], want, cliLeases[0]["token"])
		}
		res, err = http.Get(base)
		if err != nil {
			t.Fatal(err)
		}
		page, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if !strings.Contains(string(page), "<h1") || !strings.Contains(string(page), c.schema) {
			t.Fatalf("GET /: %d\n%s", res.StatusCode, page)
		}
		res, err = http.PostForm(base+"pause", url.Values{"job": {"nightly"}})
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		// Read-only: 403. With actions: the job is unknown in this schema, 404.
		want := map[bool]int{false: http.StatusForbidden, true: http.StatusNotFound}[allow]
		if res.StatusCode != want {
			t.Fatalf("allow-actions=%v: POST pause: %d, want %d", allow, res.StatusCode, want)
		}
		_ = cmd.Process.Signal(syscall.SIGINT)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("pgfence ui after SIGINT: %v", err)
			}
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatal("pgfence ui did not stop within 10s of SIGINT")
		}
	}
	if out, code := c.run("", "ui", "--refresh", "1ms"); code != exitUsage || !strings.Contains(out, "Refresh") {
		t.Fatalf("ui --refresh 1ms: %d %s", code, out)
	}
}

func keys(m map[string]any) string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return strings.Join(ks, ",")
}

// pgfence ui stops within 10 s of SIGINT while its database does not
// answer a request it serves (a partition that black-holes packets): the
// request is cut once the shutdown's grace has passed, and the pool's
// connections close in the background.
func TestUIStopsWhileItsDatabaseDoesNotAnswer(t *testing.T) {
	c := newCLI(t)
	proxy, err := faultproxy.To(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Host = proxy.Addr()
	cmd := c.cmd("", "--database-url", u.String(), "ui", "--listen", "127.0.0.1:0")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	m := regexp.MustCompile(`http://(127\.0\.0\.1:\d+)/`).FindStringSubmatch(line)
	if err != nil || m == nil {
		t.Fatalf("pgfence ui printed no address: %q, %v", line, err)
	}
	api := "http://" + m[1] + "/api/leases"
	// A connection per request: the stuck one is a new connection, which
	// the shutdown waits for (an idle kept-alive one it would close).
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	defer client.CloseIdleConnections()
	res, err := client.Get(api)
	if err != nil {
		t.Fatalf("GET api/leases before the cut: %v", err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("GET api/leases before the cut: %d", res.StatusCode)
	}
	proxy.Set(faultproxy.Blackhole)
	sent := make(chan struct{})
	req, err := http.NewRequest(http.MethodGet, api, nil)
	if err != nil {
		t.Fatal(err)
	}
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{WroteRequest: func(httptrace.WroteRequestInfo) { close(sent) }}))
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		if res, err := client.Do(req); err == nil {
			res.Body.Close()
		}
	}()
	defer func() { <-answered }() // the process's exit ends it
	select {
	case <-sent:
	case <-time.After(30 * time.Second):
		t.Fatal("the request to the page was not sent")
	}
	pgtest.Eventually(t, 30*time.Second, "the page's statement held by the cut", func() bool { return proxy.Held() > 0 })
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("pgfence ui did not stop within 10 s of SIGINT while its database did not answer")
	}
	if !strings.Contains(stderr.String(), "were cut") {
		t.Fatalf("pgfence ui stopped without a request left to cut (the test did not hold one): %s", stderr.String())
	}
}
