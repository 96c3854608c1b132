// Package autofailover runs a real pg_auto_failover formation for tests: a
// monitor, a primary and a secondary on one machine, from Debian's
// pg-auto-failover-cli and postgresql-<major>-auto-failover packages, with
// pg_auto_failover's defaults where they matter to pgfence (synchronous
// replication to the secondary, the monitor deciding every promotion) and
// health checks shortened so that a crashed primary is replaced in seconds.
// Tests ask the monitor for failovers and crash nodes (SIGKILL of
// pg_autoctl and PostgreSQL). PostgreSQL refuses to run as root, so as root
// every process runs as nobody.
package autofailover

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/pgfence/pgfence/internal/srvproc"
	"github.com/pgfence/pgfence/internal/unpriv"
)

// ErrMissing is returned when pg_auto_failover is not installed.
var ErrMissing = errors.New("autofailover: pg_autoctl, or pg_auto_failover's extension for an installed PostgreSQL, " +
	"is missing; install them (Debian: apt-get install pg-auto-failover-cli postgresql-15-auto-failover)")

// UnhealthyAfter is how long the monitor waits, with its shortened health
// checks, before it counts a node that stopped answering as failed;
// DemoteTimeout (pg_auto_failover's default, kept) is how long it then
// gives a failed primary to demote itself before it promotes the
// secondary. A crashed primary is replaced about their sum after it died.
const (
	UnhealthyAfter = 5 * time.Second
	DemoteTimeout  = 30 * time.Second
)

// Nodes is the number of data nodes.
const Nodes = 2

// Cluster is a running monitor and two data nodes.
type Cluster struct {
	dir, bin, autoctl, sock string
	monPort                 int
	monitor                 *exec.Cmd
	monDone                 <-chan struct{}
	nodes                   [Nodes]*Node
}

// Node is one data node: its pg_autoctl keeper and its PostgreSQL.
type Node struct {
	// Name is the node's name in the formation (n1, n2).
	Name string
	// Port is PostgreSQL's port on 127.0.0.1.
	Port int

	c        *Cluster
	data     string
	mu       sync.Mutex
	keeper   *exec.Cmd
	waitDone <-chan struct{}
}

// binDir finds the newest installed PostgreSQL whose pg_auto_failover
// extension is installed too.
func binDir() (string, error) {
	found, _ := filepath.Glob("/usr/share/postgresql/*/extension/pgautofailover.control")
	sort.Slice(found, func(i, j int) bool { return major(found[i]) > major(found[j]) })
	for _, f := range found {
		v := filepath.Base(filepath.Dir(filepath.Dir(f)))
		bin := filepath.Join("/usr/lib/postgresql", v, "bin")
		if _, err := os.Stat(filepath.Join(bin, "pg_ctl")); err == nil {
			return bin, nil
		}
	}
	return "", ErrMissing
}

func major(path string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(path))))
	return n
}

// Start starts the monitor, then n1 (which becomes the primary), then n2
// (which becomes its secondary), and waits until n2 is in sync.
func Start(ctx context.Context) (*Cluster, error) {
	autoctl, err := exec.LookPath("pg_autoctl")
	if err != nil {
		return nil, ErrMissing
	}
	bin, err := binDir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pgfence-autofailover-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{dir: dir, bin: bin, autoctl: autoctl, sock: filepath.Join(dir, "sock")}
	ok := false
	defer func() {
		if !ok {
			_ = c.Close()
		}
	}()
	if err := os.MkdirAll(c.sock, 0o700); err != nil {
		return nil, err
	}
	if c.monPort, err = unpriv.FreePort(); err != nil {
		return nil, err
	}
	for i := range c.nodes {
		n := &Node{Name: fmt.Sprintf("n%d", i+1), c: c, data: filepath.Join(dir, fmt.Sprintf("n%d", i+1))}
		if n.Port, err = unpriv.FreePort(); err != nil {
			return nil, err
		}
		c.nodes[i] = n
	}
	if err := unpriv.Own(dir); err != nil {
		return nil, err
	}
	mon := filepath.Join(dir, "monitor")
	// pg_autoctl takes an existing data directory as it is: initdb first,
	// with the socket directory set (the packages' own belongs to their
	// user) and the health checks shortened.
	if err := c.initdb(ctx, mon,
		"pgautofailover.health_check_period = 1000",
		"pgautofailover.health_check_timeout = 1000",
		"pgautofailover.health_check_max_retries = 1",
		"pgautofailover.health_check_retry_delay = 500",
		fmt.Sprintf("pgautofailover.node_considered_unhealthy_timeout = %d", UnhealthyAfter.Milliseconds()),
		fmt.Sprintf("pgautofailover.primary_demote_timeout = %d", DemoteTimeout.Milliseconds()),
	); err != nil {
		return nil, err
	}
	if err := c.run(ctx, "create", "monitor", "--pgdata", mon, "--pgport", strconv.Itoa(c.monPort),
		"--hostname", "127.0.0.1", "--auth", "trust", "--no-ssl", "--pgctl", filepath.Join(bin, "pg_ctl")); err != nil {
		return nil, err
	}
	if err := c.run(ctx, "config", "set", "--pgdata", mon, "postgresql.listen_addresses", "127.0.0.1"); err != nil {
		return nil, err
	}
	c.monitor = c.command("run", "--pgdata", mon)
	if c.monDone, err = srvproc.StartLogged(c.monitor, filepath.Join(dir, "monitor.log")); err != nil {
		return nil, err
	}
	if err := c.poll(ctx, 60*time.Second, "the monitor to answer", func() bool {
		_, err := c.monitorSQL(ctx, "SELECT 1")
		return err == nil
	}); err != nil {
		return nil, err
	}
	if err := c.initdb(ctx, c.nodes[0].data); err != nil {
		return nil, err
	}
	if err := c.nodes[0].create(); err != nil {
		return nil, err
	}
	if err := c.poll(ctx, 90*time.Second, "n1 to run alone", func() bool {
		return c.state(ctx, "n1") == "single/single"
	}); err != nil {
		return nil, err
	}
	if err := c.nodes[1].create(); err != nil {
		return nil, err
	}
	if err := c.WaitSettled(ctx, 120*time.Second); err != nil {
		return nil, err
	}
	ok = true
	return c, nil
}

// initdb initialises a data directory for pg_autoctl (superuser postgres)
// with extra postgresql.conf lines.
func (c *Cluster) initdb(ctx context.Context, data string, conf ...string) error {
	cmd := unpriv.Command(filepath.Join(c.bin, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
	cmd.Env = c.env()
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("autofailover: initdb %s: %v\n%s", data, err, out)
	}
	lines := append([]string{fmt.Sprintf("unix_socket_directories = '%s'", c.sock), "fsync = off"}, conf...)
	f, err := os.OpenFile(filepath.Join(data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(strings.Join(lines, "\n") + "\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// env is pg_autoctl's environment: its configuration and state files in
// the cluster's directory (it keeps them under XDG directories), and the
// cluster's socket directory for its local connections.
func (c *Cluster) env() []string {
	return append(os.Environ(), "HOME="+c.dir, "XDG_CONFIG_HOME="+filepath.Join(c.dir, "config"),
		"XDG_DATA_HOME="+filepath.Join(c.dir, "share"), "XDG_RUNTIME_DIR="+filepath.Join(c.dir, "run"),
		"PGHOST="+c.sock, "PGUSER=postgres", "PG_CONFIG="+filepath.Join(c.bin, "pg_config"), "PATH="+c.bin+":"+os.Getenv("PATH"))
}

func (c *Cluster) command(args ...string) *exec.Cmd {
	cmd := unpriv.Command(c.autoctl, args...)
	cmd.Env = c.env()
	cmd.Dir = c.dir
	return cmd
}

// run runs a pg_autoctl command to its end (killed with its process
// group if ctx ends first).
func (c *Cluster) run(ctx context.Context, args ...string) error {
	cmd := c.command(args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) })
	err := cmd.Wait()
	stop()
	if err != nil {
		return fmt.Errorf("autofailover: pg_autoctl %s: %v\n%s", strings.Join(args, " "), err, srvproc.Tail(out.Bytes()))
	}
	return nil
}

// monitorURL connects to the monitor's database.
func (c *Cluster) monitorURL() string {
	return fmt.Sprintf("postgres://autoctl_node@127.0.0.1:%d/pg_auto_failover?sslmode=disable&connect_timeout=2", c.monPort)
}

func (c *Cluster) monitorSQL(ctx context.Context, sql string) (string, error) {
	return srvproc.PSQL(ctx, c.monitorURL(), sql)
}

// state is a node's reported and assigned state ("primary/primary"), as
// the monitor has them, or "" if it cannot say.
func (c *Cluster) state(ctx context.Context, name string) string {
	out, err := c.monitorSQL(ctx, fmt.Sprintf(
		"SELECT reportedstate || '/' || goalstate FROM pgautofailover.node WHERE nodename = '%s'", name))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// WaitSettled waits until one node is the primary and the other its
// secondary, as both report and the monitor assigns, and the primary
// accepts writes.
func (c *Cluster) WaitSettled(ctx context.Context, within time.Duration) error {
	return c.poll(ctx, within, "a primary and a secondary", func() bool {
		p, err := c.primary(ctx)
		if err != nil {
			return false
		}
		for _, n := range c.nodes {
			if n != p && c.state(ctx, n.Name) != "secondary/secondary" {
				return false
			}
		}
		return true
	})
}

// primary is the node that the monitor has as primary (reported and
// assigned) and that accepts writes.
func (c *Cluster) primary(ctx context.Context) (*Node, error) {
	for _, n := range c.nodes {
		if s := c.state(ctx, n.Name); (s == "primary/primary" || s == "wait_primary/wait_primary") && n.writable(ctx) {
			return n, nil
		}
	}
	return nil, errors.New("autofailover: no primary")
}

// WaitPrimary waits until a node other than except is the primary and
// accepts writes, and returns it.
func (c *Cluster) WaitPrimary(ctx context.Context, within time.Duration, except ...*Node) (*Node, error) {
	var found *Node
	err := c.poll(ctx, within, "a primary", func() bool {
		p, err := c.primary(ctx)
		if err != nil {
			return false
		}
		for _, x := range except {
			if x == p {
				return false
			}
		}
		found = p
		return true
	})
	return found, err
}

// Failover asks the monitor for a failover (pg_autoctl perform failover:
// the secondary is promoted, the primary demoted to follow it) and waits
// for pg_autoctl to report it done.
func (c *Cluster) Failover(ctx context.Context) error {
	return c.run(ctx, "perform", "failover", "--pgdata", filepath.Join(c.dir, "monitor"), "--wait", "120")
}

// Nodes returns the data nodes.
func (c *Cluster) Nodes() [Nodes]*Node { return c.nodes }

// URL is the multi-host URL an application on pg_auto_failover uses (what
// `pg_autoctl show uri --formation default` prints): every node, the
// read-write one chosen at connect time.
func (c *Cluster) URL() string {
	hosts := make([]string, Nodes)
	for i, n := range c.nodes {
		hosts[i] = fmt.Sprintf("127.0.0.1:%d", n.Port)
	}
	return "postgres://postgres@" + strings.Join(hosts, ",") +
		"/postgres?sslmode=disable&target_session_attrs=read-write&connect_timeout=2"
}

// URL is a URL of this node alone.
func (n *Node) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable&connect_timeout=2", n.Port)
}

// create registers the node with the monitor and runs its keeper, which
// initialises it (n1 from its data directory; n2 by a base backup of the
// primary) and from then on runs it as the monitor assigns.
func (n *Node) create() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.startKeeper("create", "postgres", "--pgdata", n.data, "--pgport", strconv.Itoa(n.Port),
		"--pghost", n.c.sock, "--listen", "127.0.0.1", "--hostname", "127.0.0.1", "--name", n.Name,
		"--username", "postgres", "--dbname", "postgres", "--auth", "trust", "--no-ssl",
		"--monitor", n.c.monitorURL(), "--pgctl", filepath.Join(n.c.bin, "pg_ctl"), "--run")
}

// Start runs the node's keeper again after a crash: it starts PostgreSQL
// and rejoins the formation in whatever role the monitor assigns.
func (n *Node) Start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.startKeeper("run", "--pgdata", n.data)
}

func (n *Node) startKeeper(args ...string) error {
	if n.keeper != nil {
		return fmt.Errorf("autofailover: %s is running", n.Name)
	}
	cmd := n.c.command(args...)
	done, err := srvproc.StartLogged(cmd, filepath.Join(n.c.dir, n.Name+".log"))
	if err != nil {
		return err
	}
	n.keeper, n.waitDone = cmd, done
	return nil
}

// Crash kills the node's keeper and its PostgreSQL (every process of the
// server) with SIGKILL: a machine that died.
func (n *Node) Crash() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.keeper != nil {
		select {
		case <-n.waitDone: // exited: its process group may be another's now
		default:
			_ = syscall.Kill(-n.keeper.Process.Pid, syscall.SIGKILL)
		}
		<-n.waitDone
		n.keeper = nil
	}
	return srvproc.KillPostmaster(n.data)
}

// writable reports whether the node's PostgreSQL accepts writes now.
func (n *Node) writable(ctx context.Context) bool {
	out, err := srvproc.PSQL(ctx, n.URL(), "SELECT NOT pg_is_in_recovery()")
	return err == nil && strings.TrimSpace(out) == "t"
}

// Logs returns the tail of the node's keeper log.
func (n *Node) Logs() string {
	b, _ := os.ReadFile(filepath.Join(n.c.dir, n.Name+".log"))
	return string(srvproc.Tail(b))
}

// Close kills every process and removes the formation's files.
func (c *Cluster) Close() error {
	for _, n := range c.nodes {
		if n != nil {
			_ = n.Crash()
		}
	}
	if c.monitor != nil && c.monitor.Process != nil {
		select {
		case <-c.monDone: // exited: its process group may be another's now
		default:
			_ = syscall.Kill(-c.monitor.Process.Pid, syscall.SIGKILL)
		}
		<-c.monDone
	}
	// Also when the monitor's keeper never ran: `create monitor` may have
	// left its PostgreSQL up.
	_ = srvproc.KillPostmaster(filepath.Join(c.dir, "monitor"))
	return os.RemoveAll(c.dir)
}

func (c *Cluster) poll(ctx context.Context, within time.Duration, what string, done func() bool) error {
	err := srvproc.Poll(ctx, within, what, c.dir, func() (bool, error) { return done(), nil })
	if err != nil {
		return fmt.Errorf("autofailover: %w", err)
	}
	return nil
}
