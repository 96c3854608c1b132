package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
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
