// Command embeddb runs a throwaway private PostgreSQL server for pgfence's
// tests and examples when no server is named (no TEST_DATABASE_URL, no
// DATABASE_URL). It prints "VERSION <server major version>" and then
// "URL <connection string>" on lines of their own, keeps the server until its standard input
// closes (or it is sent SIGINT or SIGTERM), then stops it and removes -dir,
// data and all.
//
// The server is started by github.com/fergusstrange/embedded-postgres from
// the binaries in -bindir (a directory holding initdb, pg_ctl and postgres:
// a machine's PostgreSQL packages, or npm's @embedded-postgres packages), or,
// with no -bindir, from the binaries that library downloads and caches in
// -dir. PostgreSQL refuses to run as root: a root caller runs this command as
// an unprivileged user (internal/devdb does), so everything it writes is in
// -dir, which that user owns.
//
// It is a module of its own so that embedded-postgres (and the lib/pq and xz
// modules it brings) is compiled only when a throwaway server is needed:
// internal/devdb builds and runs it, and neither pgfence's go.mod nor any
// test binary depends on it.
package main

import (
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	embeddedpostgres "github.com/fergusstrange/embedded-postgres"
	_ "github.com/lib/pq" // the trust check's login
)

// database is the database created for the caller.
const database = "pgfence"

func main() {
	dir := flag.String("dir", "", "working directory (required; removed at exit)")
	bindir := flag.String("bindir", "", "directory of initdb, pg_ctl and postgres (default: download)")
	version := flag.String("version", string(embeddedpostgres.V17), "version to download when -bindir is empty")
	trust := flag.Bool("trust", false, "let clients on 127.0.0.1 log in as any role without a password")
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "embeddb: -dir is required")
		os.Exit(2)
	}
	if err := run(*dir, *bindir, embeddedpostgres.PostgresVersion(*version), *trust); err != nil {
		fmt.Fprintln(os.Stderr, "embeddb:", err)
		_ = os.RemoveAll(*dir)
		os.Exit(1)
	}
	_ = os.RemoveAll(*dir)
}

func run(dir, bindir string, version embeddedpostgres.PostgresVersion, trust bool) error {
	// From the start: a signal, or stdin closing (the caller exited), asks
	// to stop; it is acted on once the server is up (the library's start
	// cannot be interrupted), so that it is stopped, not left running. A
	// caller gone before the URL is written makes the write fail (EPIPE,
	// not SIGPIPE's death), and the server is stopped all the same.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	signal.Ignore(syscall.SIGPIPE)
	stdinDone := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, os.Stdin)
		stdinDone <- err
	}()
	// The library writes its log to a temporary file of its own: keep it
	// in dir, so it goes with the rest.
	if err := os.Setenv("TMPDIR", dir); err != nil {
		return err
	}
	password, err := randomHex(12)
	if err != nil {
		return err
	}
	cfg := embeddedpostgres.DefaultConfig().
		Version(version).
		Database(database).
		Username("postgres").
		Password(password).
		Locale("C").
		Encoding("UTF8").
		RuntimePath(filepath.Join(dir, "run")).
		DataPath(filepath.Join(dir, "data")).
		CachePath(filepath.Join(dir, "cache")).
		StartTimeout(time.Minute).
		Logger(nil).
		StartParameters(map[string]string{
			"listen_addresses": "127.0.0.1",
			// TCP only: the packages' default socket directory
			// (/var/run/postgresql) belongs to their own user, and a
			// socket in dir may pass the 107-byte limit on its path.
			"unix_socket_directories": "",
			// Throwaway data: no crash to survive.
			"fsync":           "off",
			"max_connections": "200",
		})
	binPath := filepath.Join(dir, "bin") // where the library puts what it downloads
	if bindir != "" {
		// The library takes the directory above bin/ and, finding
		// bin/pg_ctl there, downloads nothing.
		abs, err := filepath.Abs(bindir)
		if err != nil {
			return err
		}
		if _, err := os.Stat(filepath.Join(abs, "pg_ctl")); err != nil {
			return fmt.Errorf("-bindir %s: %w", bindir, err)
		}
		binPath = filepath.Dir(abs)
	}
	cfg = cfg.BinariesPath(binPath)
	var db *embeddedpostgres.EmbeddedPostgres
	var port int
	// The port is free when chosen, not always when the server binds it.
	for attempt := 0; ; attempt++ {
		if port, err = freePort(); err != nil {
			return err
		}
		db = embeddedpostgres.NewDatabase(cfg.Port(uint32(port)))
		if err = db.Start(); err == nil {
			break
		}
		// A start that failed may have left a server running (pg_ctl
		// start -w timing out): stop it, and start the next attempt
		// from an empty data directory (the library would reuse it,
		// and skip creating the database).
		stopServer(binPath, dir)
		if rerr := os.RemoveAll(filepath.Join(dir, "data")); rerr != nil {
			return rerr
		}
		taken := strings.Contains(err.Error(), "already listening") || strings.Contains(err.Error(), "already in use")
		if attempt == 2 || !taken {
			return fmt.Errorf("start PostgreSQL: %w", err)
		}
	}
	defer func() {
		if db.Stop() != nil {
			stopServer(binPath, dir)
		}
	}()
	if trust {
		if err := trustLocal(dir, port); err != nil {
			return err
		}
	}
	ver, err := os.ReadFile(filepath.Join(dir, "data", "PG_VERSION"))
	if err != nil {
		return err
	}
	if _, err := fmt.Printf("VERSION %s\nURL postgres://postgres:%s@127.0.0.1:%d/%s?sslmode=disable\n",
		strings.TrimSpace(string(ver)), password, port, database); err != nil {
		return err // the caller is gone
	}
	// Until the caller closes stdin (or exits, which closes it) or a
	// signal asks to stop.
	select {
	case err := <-stdinDone:
		if err != nil && !errors.Is(err, os.ErrClosed) {
			return err
		}
	case <-sig:
	}
	return nil
}

// stopServer stops a server the library may not know it started (an
// immediate stop: the data is thrown away).
func stopServer(binPath, dir string) {
	_ = exec.Command(filepath.Join(binPath, "bin", "pg_ctl"), "stop", "-m", "immediate", "-w",
		"-D", filepath.Join(dir, "data")).Run()
}

// trustLocal lets clients on 127.0.0.1 log in as any role without a
// password (the library's initdb asks for passwords): pgfence's tests log
// in as roles they create. It reloads the server's configuration and
// waits until a login without a password succeeds.
func trustLocal(dir string, port int) error {
	hba := filepath.Join(dir, "data", "pg_hba.conf")
	old, err := os.ReadFile(hba)
	if err != nil {
		return err
	}
	if err := os.WriteFile(hba, append([]byte("host all all 127.0.0.1/32 trust\n"), old...), 0o600); err != nil {
		return err
	}
	pid := postmasterPID(dir)
	if pid <= 0 {
		return errors.New("no server process id in postmaster.pid")
	}
	if err := syscall.Kill(pid, syscall.SIGHUP); err != nil {
		return fmt.Errorf("reload the server's configuration: %w", err)
	}
	dsn := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=%s sslmode=disable", port, database)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		db, err := sql.Open("postgres", dsn)
		if err == nil {
			err = db.Ping()
			_ = db.Close()
		}
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("login without a password after the reload: %w", err)
		}
	}
}

// postmasterPID reads the server's process id from postmaster.pid (its
// first line); 0 if it cannot (which is no process id: kill(0) would
// signal this process's group).
func postmasterPID(dir string) int {
	b, err := os.ReadFile(filepath.Join(dir, "data", "postmaster.pid"))
	if err != nil {
		return 0
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, _ := strconv.Atoi(strings.TrimSpace(first))
	return pid
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}
