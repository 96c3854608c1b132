package main

import (
	"bufio"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// Two copies: one leads; SIGTERM makes it release at once and the other
// takes over.
func TestLeaderHandsOverOnSIGTERM(t *testing.T) {
	bin := pgtest.Build(t, ".")
	schema := pgtest.Schema(t, "leader")
	type proc struct {
		cmd   *exec.Cmd
		lines chan string
	}
	startCopy := func() *proc {
		cmd := exec.Command(bin, "-schema", schema)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.URL(t))
		out, _ := cmd.StdoutPipe()
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		p := &proc{cmd, make(chan string, 100)}
		go func() {
			s := bufio.NewScanner(out)
			for s.Scan() {
				p.lines <- s.Text()
			}
			close(p.lines)
		}()
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return p
	}
	waitLine := func(p *proc, substr string, d time.Duration) bool {
		timeout := time.After(d)
		for {
			select {
			case l, ok := <-p.lines:
				if !ok {
					return false
				}
				if strings.Contains(l, substr) {
					return true
				}
			case <-timeout:
				return false
			}
		}
	}
	a := startCopy()
	if !waitLine(a, "leading with token 1", 20*time.Second) {
		t.Fatal("first copy never led")
	}
	b := startCopy()
	if !waitLine(b, "campaigning", 20*time.Second) {
		t.Fatal("second copy did not start")
	}
	time.Sleep(300 * time.Millisecond)
	_ = a.cmd.Process.Signal(syscall.SIGTERM)
	if !waitLine(a, "stepped down; lease released", 5*time.Second) {
		t.Fatal("leader did not step down on SIGTERM")
	}
	if err := a.cmd.Wait(); err != nil {
		t.Fatalf("leader exit: %v", err)
	}
	if !waitLine(b, "leading with token 2", 2*time.Second) {
		t.Fatal("second copy did not take over within 2s")
	}
}
