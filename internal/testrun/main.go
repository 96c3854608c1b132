// Command testrun runs pgfence's tests the way README's test command gives
// them and prints what plain `go test ./...` keeps to itself when a package
// passes: which tests were skipped, and why (a test that needs PgBouncer,
// Patroni or the PostgreSQL server binaries skips with a message naming the
// tool and how to install it; with CI=true it fails instead).
//
//	TEST_DATABASE_URL='postgres://postgres@127.0.0.1:5432/test?sslmode=disable' go run ./internal/testrun
//
// Without arguments it runs `go test -race -count=1 -p 1 ./...` in the main
// module and then in the ops module; arguments, if any, replace those and
// run in the main module only (`go run ./internal/testrun -count=1 ./lock`). It
// prints one line per package, the output of failed tests and of packages
// that did not build, then the skipped tests, and exits with go test's
// status.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"
)

// event is one line of `go test -json` (cmd/test2json).
type event struct {
	Action     string
	Package    string
	ImportPath string // build-output, build-fail
	Test       string
	Elapsed    float64
	Output     string
}

// skip is one skipped test and the reason it gave.
type skip struct{ pkg, test, reason string }

// modules are the project's modules whose tests the default run includes
// besides the main one: ops (the alerting rules and dashboard, tested
// against a real Prometheus; a module of its own so that the Prometheus
// exporter stays out of importers' go.sum).
var modules = []string{"ops"}

func main() {
	args := os.Args[1:]
	dirs := []string{"."}
	if len(args) == 0 {
		args = []string{"-race", "-count=1", "-p", "1", "./..."}
		dirs = append(dirs, modules...)
	}
	start := time.Now()
	code := 0
	var skips []skip
	for _, dir := range dirs {
		s, c := run(dir, args)
		skips = append(skips, s...)
		code = max(code, c)
	}
	printSkips(os.Stdout, skips)
	verdict := "ok"
	if code != 0 {
		verdict = "FAIL"
	}
	fmt.Printf("%s in %s\n", verdict, time.Since(start).Round(time.Second))
	os.Exit(code)
}

// run runs go test -json with args in dir, writes its summary, and
// returns the skipped tests and go test's exit code.
func run(dir string, args []string) ([]skip, int) {
	cmd := exec.Command("go", append([]string{"test", "-json"}, args...)...)
	cmd.Dir = dir
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		fmt.Fprintln(os.Stderr, "testrun:", err)
		return nil, 1
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "testrun:", err)
		return nil, 1
	}
	skips := report(out, os.Stdout)
	err = cmd.Wait()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return skips, exit.ExitCode()
	case err != nil:
		fmt.Fprintln(os.Stderr, "testrun:", err)
		return skips, 1
	}
	return skips, 0
}

// report reads go test's JSON events from r and writes the summary to w as
// they come: a line per package, the output of every failed test or
// package, and build failures. It returns the skipped tests.
func report(r io.Reader, w io.Writer) []skip {
	var (
		skips   []skip
		output  = map[string][]string{} // package + "\x00" + test -> its output lines
		started []string                // the keys of output, in the order of their first line
	)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<26)
	for sc.Scan() {
		var ev event
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil || ev.Action == "" {
			fmt.Fprintln(w, sc.Text()) // not an event: pass it on
			continue
		}
		key := ev.Package + "\x00" + ev.Test
		switch ev.Action {
		case "build-output":
			fmt.Fprint(w, ev.Output)
		case "output":
			if _, ok := output[key]; !ok {
				started = append(started, key)
			}
			output[key] = append(output[key], ev.Output)
		case "skip":
			if ev.Test == "" {
				fmt.Fprintf(w, "?   \t%s\t[no test files]\n", ev.Package)
			} else {
				skips = append(skips, skip{ev.Package, ev.Test, reason(output[key])})
			}
			delete(output, key)
		case "pass":
			if ev.Test == "" {
				fmt.Fprintf(w, "ok  \t%s\t%.1fs\n", ev.Package, ev.Elapsed)
			}
			delete(output, key)
		case "fail":
			for _, l := range output[key] {
				if !noise(l, ev.Package) {
					fmt.Fprint(w, l)
				}
			}
			if ev.Test == "" {
				// Tests with no result of their own: a timeout's or a
				// panic's, whose message and goroutines go test gives as
				// the output of the last test that ran.
				for _, k := range started {
					pkg, test, _ := strings.Cut(k, "\x00")
					lines, ok := output[k]
					if pkg != ev.Package || test == "" || !ok {
						continue
					}
					fmt.Fprintf(w, "--- NO RESULT: %s\n", test)
					printCapped(w, lines, ev.Package)
					delete(output, k)
				}
				fmt.Fprintf(w, "FAIL\t%s\t%.1fs\n", ev.Package, ev.Elapsed)
			}
			delete(output, key)
		}
	}
	if err := sc.Err(); err != nil {
		fmt.Fprintln(w, "testrun: reading go test's output:", err)
	}
	return skips
}

// maxUnfinishedLines caps the output printed for a test with no result (a
// timeout's goroutine dump can run to many thousands of lines).
const maxUnfinishedLines = 3000

// printCapped prints the lines that are not noise, at most
// maxUnfinishedLines of them.
func printCapped(w io.Writer, lines []string, pkg string) {
	n := 0
	for _, l := range lines {
		if noise(l, pkg) {
			continue
		}
		if n == maxUnfinishedLines {
			fmt.Fprintf(w, "... (more lines left out)\n")
			return
		}
		fmt.Fprint(w, l)
		n++
	}
}

// noise reports the lines of a failure's output that the summary already
// says: the "=== RUN" markers and go test's own result lines.
func noise(line, pkg string) bool {
	t := strings.TrimSpace(line)
	return strings.HasPrefix(t, "=== ") || t == "FAIL" || t == "PASS" || strings.HasPrefix(t, "FAIL\t"+pkg) ||
		strings.HasPrefix(t, "ok  \t"+pkg)
}

// reason picks a skipped test's message out of its output: the lines
// between "=== RUN" and "--- SKIP", with the file:line prefix kept.
func reason(lines []string) string {
	var msg []string
	for _, l := range lines {
		t := strings.TrimSpace(l)
		if t == "" || strings.HasPrefix(t, "=== ") || strings.HasPrefix(t, "--- ") {
			continue
		}
		msg = append(msg, t)
	}
	if len(msg) == 0 {
		return "(no message)"
	}
	return strings.Join(msg, " ")
}

func printSkips(w io.Writer, skips []skip) {
	if len(skips) == 0 {
		fmt.Fprintln(w, "no test skipped")
		return
	}
	fmt.Fprintf(w, "%d skipped:\n", len(skips))
	for _, s := range skips {
		fmt.Fprintf(w, "  %s %s: %s\n", s.pkg, s.test, s.reason)
	}
}
