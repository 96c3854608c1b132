// Package bouncer runs a private PgBouncer in transaction pooling mode in
// front of a PostgreSQL server, for tests that check pgfence through it.
// PgBouncer refuses to run as root, so as root it runs as nobody.
package bouncer

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/pgfence/pgfence/internal/unpriv"
)

// ErrNoBinary is returned when the pgbouncer binary is not installed.
var ErrNoBinary = errors.New("bouncer: pgbouncer is not on PATH; install it " +
	"(Debian: apt-get install pgbouncer, which puts it in /usr/sbin) or set PGFENCE_PGBOUNCER to its path")

// Bouncer is a running PgBouncer.
type Bouncer struct {
	dir  string
	port int
	cmd  *exec.Cmd
}

// Start runs PgBouncer in transaction mode on a free port of 127.0.0.1,
// forwarding every database to upstream (host:port) as user, with trust
// authentication and at most poolSize server connections per database.
func Start(upstream, user string, poolSize int) (*Bouncer, error) {
	bin := os.Getenv("PGFENCE_PGBOUNCER")
	if bin == "" {
		bin = "pgbouncer"
	}
	bin, err := exec.LookPath(bin)
	if err != nil {
		return nil, ErrNoBinary
	}
	host, port, err := net.SplitHostPort(upstream)
	if err != nil {
		return nil, fmt.Errorf("bouncer: upstream %q: %w", upstream, err)
	}
	dir, err := os.MkdirTemp("", "pgfence-bouncer-")
	if err != nil {
		return nil, err
	}
	listen, err := unpriv.FreePort()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
default_pool_size = %d
max_client_conn = 500
server_reset_query =
logfile = %s
pidfile = %s
`, host, port, listen, filepath.Join(dir, "users.txt"), poolSize, filepath.Join(dir, "log"), filepath.Join(dir, "pid"))
	files := map[string]string{"pgbouncer.ini": ini, "users.txt": fmt.Sprintf("%q \"\"\n", user)}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
	args := []string{filepath.Join(dir, "pgbouncer.ini")}
	if err := unpriv.Own(dir); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("bouncer: %w", err)
	}
	cmd := unpriv.Command(bin, args...)
	if err := cmd.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("bouncer: start: %w", err)
	}
	b := &Bouncer{dir: dir, port: listen, cmd: cmd}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", b.Addr(), time.Second)
		if err == nil {
			_ = c.Close()
			return b, nil
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "log"))
			_ = b.Close()
			return nil, fmt.Errorf("bouncer: not listening after 10s: %v\n%s", err, log)
		}
	}
}

// Addr is PgBouncer's host:port.
func (b *Bouncer) Addr() string { return fmt.Sprintf("127.0.0.1:%d", b.port) }

// URL returns a connection URL for database db through PgBouncer, with
// extra query parameters (e.g. "default_query_exec_mode=exec").
func (b *Bouncer) URL(user, db string, params ...string) string {
	return fmt.Sprintf("postgres://%s@%s/%s?%s", user, b.Addr(), db, strings.Join(append([]string{"sslmode=disable"}, params...), "&"))
}

// Close stops PgBouncer and removes its directory.
func (b *Bouncer) Close() error {
	if b.cmd.Process != nil {
		_ = b.cmd.Process.Kill()
		_ = b.cmd.Wait()
	}
	return os.RemoveAll(b.dir)
}
