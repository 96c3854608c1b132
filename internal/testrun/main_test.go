package main

import (
	"bytes"
	"strings"
	"testing"
)

// The summary keeps what go test hides for passing packages: each skipped
// test with its message; and it shows a failed test's output once.
func TestReportListsSkipsAndFailures(t *testing.T) {
	in := strings.Join([]string{
		`{"Action":"start","Package":"p/a"}`,
		`{"Action":"run","Package":"p/a","Test":"TestTool"}`,
		`{"Action":"output","Package":"p/a","Test":"TestTool","Output":"=== RUN   TestTool\n"}`,
		`{"Action":"output","Package":"p/a","Test":"TestTool","Output":"    x_test.go:9: skipped: pgbouncer is not on PATH\n"}`,
		`{"Action":"output","Package":"p/a","Test":"TestTool","Output":"--- SKIP: TestTool (0.00s)\n"}`,
		`{"Action":"skip","Package":"p/a","Test":"TestTool"}`,
		`{"Action":"output","Package":"p/a","Test":"TestOK","Output":"=== RUN   TestOK\n"}`,
		`{"Action":"pass","Package":"p/a","Test":"TestOK"}`,
		`{"Action":"pass","Package":"p/a","Elapsed":1.25}`,
		`{"Action":"output","Package":"p/b","Test":"TestBad","Output":"=== RUN   TestBad\n"}`,
		`{"Action":"output","Package":"p/b","Test":"TestBad","Output":"    b_test.go:3: boom\n"}`,
		`{"Action":"fail","Package":"p/b","Test":"TestBad"}`,
		`{"Action":"output","Package":"p/b","Output":"FAIL\n"}`,
		`{"Action":"output","Package":"p/b","Output":"FAIL\tp/b\t0.1s\n"}`,
		`{"Action":"fail","Package":"p/b","Elapsed":0.1}`,
		`{"ImportPath":"p/c","Action":"build-output","Output":"c.go:1: syntax error\n"}`,
		`{"ImportPath":"p/c","Action":"build-fail"}`,
		`{"Action":"skip","Package":"p/d"}`,
		`not json`,
	}, "\n")
	var out bytes.Buffer
	skips := report(strings.NewReader(in), &out)
	if len(skips) != 1 || skips[0] != (skip{"p/a", "TestTool", "x_test.go:9: skipped: pgbouncer is not on PATH"}) {
		t.Fatalf("skips = %#v", skips)
	}
	want := "ok  \tp/a\t1.2s\n" +
		"    b_test.go:3: boom\n" +
		"FAIL\tp/b\t0.1s\n" +
		"c.go:1: syntax error\n" +
		"?   \tp/d\t[no test files]\n" +
		"not json\n"
	if out.String() != want {
		t.Fatalf("summary:\n%s\nwant:\n%s", out.String(), want)
	}
	var list bytes.Buffer
	printSkips(&list, skips)
	if got := list.String(); got != "1 skipped:\n  p/a TestTool: x_test.go:9: skipped: pgbouncer is not on PATH\n" {
		t.Fatalf("skip list = %q", got)
	}
}

// A package that times out: the tests still running have no result of their
// own, and the panic goes to the last one's output; the summary names each
// of them with its output, the panic included.
func TestReportShowsTestsWithNoResult(t *testing.T) {
	in := strings.Join([]string{
		`{"Action":"output","Package":"p/t","Test":"TestOK","Output":"=== RUN   TestOK\n"}`,
		`{"Action":"pass","Package":"p/t","Test":"TestOK"}`,
		`{"Action":"output","Package":"p/t","Test":"TestHang","Output":"=== RUN   TestHang\n"}`,
		`{"Action":"output","Package":"p/t","Test":"TestHang","Output":"    x_test.go:3: before\n"}`,
		`{"Action":"output","Package":"p/t","Test":"TestHang2","Output":"=== RUN   TestHang2\n"}`,
		`{"Action":"output","Package":"p/t","Test":"TestHang2","Output":"panic: test timed out after 2s\n"}`,
		`{"Action":"output","Package":"p/t","Test":"TestHang2","Output":"\trunning tests:\n"}`,
		`{"Action":"output","Package":"p/t","Test":"TestHang2","Output":"\t\tTestHang (2s)\n"}`,
		`{"Action":"fail","Package":"p/t","Elapsed":2}`,
	}, "\n")
	var out bytes.Buffer
	report(strings.NewReader(in), &out)
	want := "--- NO RESULT: TestHang\n" +
		"    x_test.go:3: before\n" +
		"--- NO RESULT: TestHang2\n" +
		"panic: test timed out after 2s\n" +
		"\trunning tests:\n" +
		"\t\tTestHang (2s)\n" +
		"FAIL\tp/t\t2.0s\n"
	if out.String() != want {
		t.Fatalf("summary:\n%s\nwant:\n%s", out.String(), want)
	}
}
