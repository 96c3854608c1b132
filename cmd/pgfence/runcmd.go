package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/internal/wait"
	"github.com/pgfence/pgfence/lock"
)

// cmdRun runs a command while holding a lease: renewed while the command
// runs, its token exported as PGFENCE_TOKEN, the command terminated (SIGTERM,
// then SIGKILL after --grace) if the lease is lost.
func cmdRun(ctx context.Context, e *env, args []string) error {
	var (
		name     string
		ttl      time.Duration
		grace    time.Duration
		blocking bool
	)
	fs, err := parse(e, "run", args, func(fs *flag.FlagSet) {
		fs.StringVar(&name, "lease", "", "lease name (required)")
		fs.DurationVar(&ttl, "ttl", 15*time.Second, "lease TTL; renewed every TTL/3 while COMMAND runs")
		fs.DurationVar(&grace, "grace", 10*time.Second, "time between SIGTERM and SIGKILL when the lease is lost")
		fs.BoolVar(&blocking, "wait", false, "wait for the lease instead of exiting with 75 when it is held")
	})
	if err != nil {
		return err
	}
	switch {
	case name == "":
		fs.Usage()
		return fail(exitUsage, "--lease is required")
	case fs.NArg() == 0:
		fs.Usage()
		return fail(exitUsage, "missing command after --")
	case ttl <= 0:
		return fail(exitUsage, "--ttl must be positive, got %v", ttl)
	case grace < 0:
		return fail(exitUsage, "--grace must not be negative, got %v", grace)
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	c, err := lock.New(pool, lock.Config{Schema: e.schema, TTL: ttl})
	if err != nil {
		var ce *lock.ConfigError
		if errors.As(err, &ce) {
			return fail(exitUsage, "%v", err)
		}
		return err
	}
	// Close frees the lease and ends the client's session in one
	// transaction, within wait.CleanupTimeout (a lease not freed expires
	// by its TTL). Once the command has started, it runs while signals
	// are still caught; deferred, on the paths before.
	closed := false
	closeClient := func() {
		if closed {
			return
		}
		closed = true
		cctx, cancel := context.WithTimeout(context.Background(), wait.CleanupTimeout)
		defer cancel()
		_ = c.Close(cctx)
	}
	defer closeClient()

	var l *lock.Lease
	if blocking {
		l, err = c.Acquire(ctx, name)
	} else {
		l, err = c.TryAcquire(ctx, name)
	}
	var held *lock.HeldError
	switch {
	case errors.As(err, &held):
		return fail(exitHeld, "lease %q is held by %s until %s", name, held.Holder, held.ExpiresAt.UTC().Format(time.RFC3339))
	case errors.Is(err, lock.ErrInvalidName):
		return fail(exitUsage, "--lease: %v", err)
	case err != nil && ctx.Err() != nil:
		return fail(exitError, "interrupted while waiting for lease %q", name)
	case err != nil:
		return err
	}

	cmd := exec.Command(fs.Arg(0), fs.Args()[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, e.stdout, e.stderr
	cmd.Env = append(os.Environ(), "PGFENCE_TOKEN="+l.Token().String(), "PGFENCE_LEASE="+name)
	// Its own process group, so that terminating it reaches its children.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// Caught before the command starts: from then on, every signal is
	// the command's.
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(signals)
	if err := cmd.Start(); err != nil {
		return fail(exitError, "start %s: %v", fs.Arg(0), err)
	}
	var waitErr error
	waited := bg.Run(context.Background(), func(context.Context) { waitErr = cmd.Wait() }) // the command's end, waited for on every path
	group := func(sig syscall.Signal) { _ = syscall.Kill(-cmd.Process.Pid, sig) }

	for {
		select {
		case <-waited.Done():
			closeClient()
			return exitCode(waitErr)
		case sig := <-signals:
			group(sig.(syscall.Signal)) // pass it on; the command decides
		case <-l.Done():
			fmt.Fprintf(e.stderr, "pgfence: %v; terminating %s\n", l.Err(), fs.Arg(0))
			group(syscall.SIGTERM)
			select {
			case <-waited.Done():
			case <-time.After(grace):
				group(syscall.SIGKILL)
				<-waited.Done()
			}
			closeClient()
			return &cliError{exitLost, errors.New("")}
		}
	}
}

// exitCode turns the command's outcome into pgfence's exit.
func exitCode(err error) error {
	if err == nil {
		return nil
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return err
	}
	if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return &cliError{128 + int(ws.Signal()), errors.New("")}
	}
	return &cliError{ee.ExitCode(), errors.New("")}
}
