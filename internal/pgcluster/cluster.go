// Package pgcluster runs a private PostgreSQL cluster for tests that must
// crash and restart the server: initdb into a temporary directory, a free
// port on 127.0.0.1, and pg_ctl to start it and to stop it "immediate" (a
// crash: no shutdown checkpoint, recovery from WAL on the next start).
// PostgreSQL refuses to run as root, so as root the server runs as nobody.
package pgcluster

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"github.com/pgfence/pgfence/internal/devdb"
	"github.com/pgfence/pgfence/internal/unpriv"
)

// ErrNoServer is returned when no PostgreSQL server binaries are installed.
var ErrNoServer = devdb.ErrNoServer

// BinDir finds the server binaries: $PGFENCE_PG_BINDIR, `pg_config
// --bindir`, or the newest /usr/lib/postgresql/*/bin.
func BinDir() (string, error) { return devdb.BinDir() }

// Cluster is a private PostgreSQL server.
type Cluster struct {
	bin, dir string
	port     int

	mu      sync.Mutex
	running bool
}

// New initialises a cluster in a new temporary directory and starts it.
// extraConf lines are appended to postgresql.conf.
func New(extraConf ...string) (*Cluster, error) {
	return NewTrusting(nil, extraConf...)
}

// NewTrusting is New for a server that also lets clients from the
// addresses in cidrs connect without a password (as initdb's trust lets
// clients on 127.0.0.1), from its start on; give it a listen_addresses
// line that covers them.
func NewTrusting(cidrs []string, extraConf ...string) (*Cluster, error) {
	c, err := prepare()
	if err != nil {
		return nil, err
	}
	if err := c.pg("initdb", "-D", c.data(), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"); err != nil {
		_ = os.RemoveAll(c.dir)
		return nil, err
	}
	for _, cidr := range cidrs {
		if err := c.appendFile("pg_hba.conf", "host all all "+cidr+" trust\n"); err != nil {
			_ = os.RemoveAll(c.dir)
			return nil, err
		}
	}
	return c.configureAndStart(extraConf)
}

// NewStandby makes a streaming standby of a primary reached at
// primaryAddr (host:port; a proxy in front of the primary lets a test cut
// replication) with pg_basebackup, and starts it.
func NewStandby(primaryAddr string, extraConf ...string) (*Cluster, error) {
	c, err := fromBackup(primaryAddr, "-R")
	if err != nil {
		return nil, err
	}
	return c.configureAndStart(extraConf)
}

// NewRestored restores a base backup of the primary at primaryAddr the way
// a point-in-time recovery does (recovery.signal: archive recovery, here
// from the WAL the backup carries), and starts it. Archive recovery ends
// on a new timeline, as every point-in-time recovery does.
func NewRestored(primaryAddr string, extraConf ...string) (*Cluster, error) {
	c, err := fromBackup(primaryAddr)
	if err != nil {
		return nil, err
	}
	if err := c.writeFile("recovery.signal", ""); err != nil {
		_ = os.RemoveAll(c.dir)
		return nil, err
	}
	return c.configureAndStart(append([]string{"restore_command = 'false'"}, extraConf...))
}

// fromBackup prepares a cluster whose data directory is a base backup of
// the primary at primaryAddr (flags added to pg_basebackup's).
func fromBackup(primaryAddr string, flags ...string) (*Cluster, error) {
	c, err := prepare()
	if err != nil {
		return nil, err
	}
	host, port, err := net.SplitHostPort(primaryAddr)
	if err != nil {
		return nil, err
	}
	args := append([]string{"-D", c.data(), "-h", host, "-p", port, "-U", "postgres", "-X", "stream", "--no-sync"}, flags...)
	if err := c.pg("pg_basebackup", args...); err != nil {
		_ = os.RemoveAll(c.dir)
		return nil, err
	}
	return c, nil
}

// Stop shuts the server down cleanly.
func (c *Cluster) Stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.running = false
	return c.pg("pg_ctl", "-D", c.data(), "-m", "fast", "-w", "stop")
}

// Rewind makes this stopped cluster, a primary that went on alone after
// another was promoted, a copy of the server at sourceURL with pg_rewind
// (the cluster needs wal_log_hints = on), then Follow makes it its standby.
func (c *Cluster) Rewind(sourceURL string) error {
	if err := c.pg("pg_rewind", "--target-pgdata", c.data(), "--source-server", sourceURL, "--no-sync"); err != nil {
		return err
	}
	return c.configure(nil) // pg_rewind copied the source's configuration
}

// Follow configures this stopped cluster as a streaming standby of the
// primary at primaryAddr and starts it.
func (c *Cluster) Follow(primaryAddr string) error {
	host, port, err := net.SplitHostPort(primaryAddr)
	if err != nil {
		return err
	}
	if err := c.writeFile("standby.signal", ""); err != nil {
		return err
	}
	if err := c.appendFile("postgresql.auto.conf", fmt.Sprintf("primary_conninfo = 'host=%s port=%s user=postgres'\n", host, port)); err != nil {
		return err
	}
	return c.Start()
}

// writeFile writes a file into the data directory, owned by the server's user.
func (c *Cluster) writeFile(name, content string) error {
	p := filepath.Join(c.data(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		return err
	}
	return unpriv.Own(p)
}

func prepare() (*Cluster, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pgfence-cluster-")
	if err != nil {
		return nil, err
	}
	port, err := unpriv.FreePort()
	if err != nil {
		return nil, err
	}
	c := &Cluster{bin: bin, dir: dir, port: port}
	if err := unpriv.Own(dir); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("pgcluster: %w", err)
	}
	return c, nil
}

func (c *Cluster) configureAndStart(extraConf []string) (*Cluster, error) {
	err := c.configure(extraConf)
	if err == nil {
		err = c.Start()
	}
	if err != nil {
		_ = os.RemoveAll(c.dir)
		return nil, err
	}
	return c, nil
}

// configure appends this cluster's settings (port, socket directory) and
// extraConf to postgresql.conf; later lines win.
func (c *Cluster) configure(extraConf []string) error {
	conf := fmt.Sprintf("port = %d\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '%s'\n"+
		// A process crash keeps the OS page cache, so WAL needs no fsync to
		// survive pg_ctl stop -m immediate; this only speeds the suite up.
		"fsync = off\nmax_connections = 200\nlog_min_messages = fatal\n", c.port, c.dir)
	for _, l := range extraConf {
		conf += l + "\n"
	}
	return c.appendFile("postgresql.conf", conf)
}

// appendFile appends text to a file of the data directory.
func (c *Cluster) appendFile(name, text string) error {
	f, err := os.OpenFile(filepath.Join(c.data(), name), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(text)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Promote turns a standby into a primary and waits until it accepts writes.
func (c *Cluster) Promote() error {
	return c.pg("pg_ctl", "-D", c.data(), "-w", "-t", "60", "promote")
}

func (c *Cluster) data() string { return filepath.Join(c.dir, "data") }

// URL is the cluster's connection URL (database postgres, user postgres).
func (c *Cluster) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.port)
}

// URLAt is the cluster's connection URL through another of the addresses
// it listens on (a listen_addresses line given to New).
func (c *Cluster) URLAt(host string) string {
	return fmt.Sprintf("postgres://postgres@%s:%d/postgres?sslmode=disable", host, c.port)
}

// Addr is the server's host:port.
func (c *Cluster) Addr() string { return fmt.Sprintf("127.0.0.1:%d", c.port) }

// Start starts the server and waits until it accepts connections (after
// crash recovery, if it crashed).
func (c *Cluster) Start() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.pg("pg_ctl", "-D", c.data(), "-l", filepath.Join(c.dir, "log"), "-w", "-t", "60", "start"); err != nil {
		return err
	}
	c.running = true
	return nil
}

// Crash stops the server the way a crash does: every backend is killed at
// once, with no shutdown checkpoint.
func (c *Cluster) Crash() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.running = false
	return c.pg("pg_ctl", "-D", c.data(), "-m", "immediate", "-w", "stop")
}

// Close stops the server and removes its directory.
func (c *Cluster) Close() error {
	c.mu.Lock()
	running := c.running
	c.mu.Unlock()
	if running {
		_ = c.pg("pg_ctl", "-D", c.data(), "-m", "fast", "-w", "stop")
	}
	return os.RemoveAll(c.dir)
}

// command prepares one of the server's programs, to run as nobody when we
// are root.
func (c *Cluster) command(name string, args ...string) *exec.Cmd {
	cmd := unpriv.Command(filepath.Join(c.bin, name), args...)
	cmd.Dir = c.dir
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	return cmd
}

// pg runs a server binary.
func (c *Cluster) pg(name string, args ...string) error {
	cmd := c.command(name, args...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("pgcluster: %s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return nil
}

// Output runs one of the server's client programs (pg_dump, psql) as the
// server's user, with stdin, and returns what it printed on stdout.
func (c *Cluster) Output(stdin []byte, name string, args ...string) ([]byte, error) {
	cmd := c.command(name, args...)
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("pgcluster: %s %s: %v\n%s", name, strings.Join(args, " "), err, stderr.String())
	}
	return out, nil
}

// Log returns the server's log (for a failing test to show).
func (c *Cluster) Log() string {
	b, _ := os.ReadFile(filepath.Join(c.dir, "log"))
	return string(b)
}
