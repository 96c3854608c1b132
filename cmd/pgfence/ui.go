package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/pgfence/pgfence/internal/bg"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/web"
)

// cmdUI serves the status page (package web) until interrupted.
func cmdUI(ctx context.Context, e *env, args []string) error {
	var (
		listen  string
		allow   bool
		refresh time.Duration
		hosts   []string
	)
	fs, err := parse(e, "ui", args, func(fs *flag.FlagSet) {
		fs.StringVar(&listen, "listen", "127.0.0.1:8080", "address to serve the page on (localhost by default)")
		fs.BoolVar(&allow, "allow-actions", false, "offer force release, run now, pause and resume on the page")
		fs.DurationVar(&refresh, "refresh", time.Second, "how often an open page updates")
		fs.Func("host", "a `name` the page is served under, besides localhost and IP addresses (repeatable)", func(s string) error {
			hosts = append(hosts, s)
			return nil
		})
	})
	if err != nil {
		return err
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return fail(exitUsage, "ui takes no arguments")
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	defer closePool(pool)
	// An unmigrated (or mistyped) schema is refused at start, as an
	// unreachable database is: every page would answer 500.
	if err := migrations.Verify(ctx, pool, e.schema); err != nil {
		return err
	}
	h, err := web.New(pool, web.Config{Schema: e.schema, Hosts: hosts, AllowActions: allow, Refresh: refresh, Logger: slog.New(slog.NewTextHandler(e.stderr, nil))})
	if errors.Is(err, web.ErrInvalidConfig) {
		return fail(exitUsage, "%v", err)
	}
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fail(exitError, "--listen: %v", err)
	}
	actions := "read-only (--allow-actions to offer force release, run now, pause, resume)"
	if allow {
		actions = "actions enabled"
	}
	// The address to open: a wildcard listener is reached on loopback.
	at := ln.Addr().(*net.TCPAddr)
	open := at.String()
	if at.IP.IsUnspecified() {
		open = net.JoinHostPort("127.0.0.1", strconv.Itoa(at.Port))
	}
	fmt.Fprintf(e.stdout, "pgfence status page of schema %s: http://%s/ (%s); Ctrl-C stops it\n", e.schemaName(), open, actions)
	if ip := ln.Addr().(*net.TCPAddr).IP; !ip.IsLoopback() {
		fmt.Fprintf(e.stderr, "pgfence: warning: listening on %s, beyond this machine: whoever reaches it reads the page%s\n",
			ln.Addr(), map[bool]string{true: " and can steer jobs and release leases", false: ""}[allow])
	}
	// Requests end with base: once the shutdown's grace has passed, those
	// still running (their database may not answer) are cut.
	base, cut := context.WithCancel(context.WithoutCancel(ctx))
	defer cut()
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, BaseContext: func(net.Listener) context.Context { return base }}
	var serveErr error
	serve := bg.Run(ctx, func(context.Context) { serveErr = srv.Serve(ln) }) // ended by Shutdown, waited for below
	select {
	case <-serve.Done():
		return serveErr
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		cut()
		return fmt.Errorf("requests still running after 5 s were cut: %w", err)
	}
	<-serve.Done()
	return nil
}
