// Package srvproc holds what the test harnesses of real HA stacks
// (internal/patroni, internal/autofailover) do alike with the processes
// they run: start one logged in a process group of its own, kill a
// postmaster and its children, ask a server with psql, and poll.
package srvproc

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// StartLogged starts cmd with its output appended to logFile, in a process
// group of its own, and returns a channel closed once it has exited (its
// one waiter is a goroutine that ends then).
func StartLogged(cmd *exec.Cmd, logFile string) (<-chan struct{}, error) {
	f, err := os.OpenFile(logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	err = cmd.Start()
	f.Close()
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	return done, nil
}

// KillPostmaster kills the postmaster recorded in a data directory and
// every process of its session and its children (a manager may start
// PostgreSQL in a session of its own), children first so that none
// lingers holding the port. A directory with no postmaster.pid is no
// error.
func KillPostmaster(data string) error {
	b, err := os.ReadFile(filepath.Join(data, "postmaster.pid"))
	if err != nil {
		return nil // not running
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	if err != nil || pid <= 1 || !isPostmasterOf(pid, data) {
		return nil // a file a crash left, its process gone (the pid may be another's now)
	}
	_ = exec.Command("pkill", "-KILL", "-s", strconv.Itoa(pid)).Run()
	_ = exec.Command("pkill", "-KILL", "-P", strconv.Itoa(pid)).Run()
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for range 100 {
		if syscall.Kill(pid, 0) != nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("srvproc: postmaster %d in %s did not die", pid, data)
}

// isPostmasterOf reports whether process pid is a postgres whose command
// line names data (its -D), so that a stale postmaster.pid does not make
// KillPostmaster kill whatever process reused the pid.
func isPostmasterOf(pid int, data string) bool {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	if err != nil {
		return false
	}
	args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
	return len(args) > 0 && filepath.Base(args[0]) == "postgres" && slices.Contains(args, data)
}

// PSQL runs one statement through psql (bounded by 3 s) and returns what
// it printed, unaligned and without headers.
func PSQL(ctx context.Context, url, sql string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "psql", "-XAtq", url, "-c", sql).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("psql: %v: %s", err, out)
	}
	return string(out), nil
}

// Poll calls done every 100 ms until it reports true or an error, and
// fails, naming what it waited for and where the logs are, once within
// has passed.
func Poll(ctx context.Context, within time.Duration, what, logs string, done func() (bool, error)) error {
	deadline := time.Now().Add(within)
	for {
		ok, err := done()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no %s within %v (logs in %s)", what, within, logs)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Tail is the last 4,000 bytes of a log.
func Tail(b []byte) []byte {
	if len(b) > 4000 {
		return b[len(b)-4000:]
	}
	return b
}
