// Package patroni runs a real high-availability PostgreSQL cluster for tests:
// one etcd member and three Patroni nodes on one machine, from Debian's
// patroni and etcd-server packages, with Patroni's defaults where they
// matter to pgfence (asynchronous replication, no shared WAL archive,
// pg_rewind for rejoining) and ttl 10 s, loop_wait 2 s. Tests crash nodes
// (SIGKILL of Patroni and PostgreSQL), freeze them (SIGSTOP), stall their
// replication and ask for switchovers, the way production failovers happen.
// PostgreSQL refuses to run as root, so as root every process runs as nobody.
package patroni

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/pgfence/pgfence/internal/pgcluster"
	"github.com/pgfence/pgfence/internal/srvproc"
	"github.com/pgfence/pgfence/internal/unpriv"
)

// ErrMissing is returned when Patroni or etcd is not installed.
var ErrMissing = errors.New("patroni: patroni and etcd are not on PATH; " +
	"install them (Debian: apt-get install patroni etcd-server)")

// TTL and LoopWait are the cluster's Patroni timings: a crashed primary is
// replaced about TTL after its last heartbeat.
const (
	TTL      = 10 * time.Second
	LoopWait = 2 * time.Second
)

// Nodes is the number of Patroni nodes.
const Nodes = 3

// Cluster is a running etcd member and three Patroni nodes.
type Cluster struct {
	dir      string
	scope    string
	etcd     *exec.Cmd
	etcdDone <-chan struct{}
	nodes    [Nodes]*Node
	http     *http.Client
}

// Node is one Patroni node and its PostgreSQL server.
type Node struct {
	// Name is the Patroni member name (n1, n2, n3).
	Name string
	// Port is PostgreSQL's port on 127.0.0.1.
	Port int

	c          *Cluster
	patroniBin string
	rest       int
	conf       string
	data       string
	mu         sync.Mutex
	patroni    *exec.Cmd
	waitDone   <-chan struct{}
}

// lookPath finds a tool on PATH, as every test that needs one does, so
// that taking it off PATH is how a test run does without it.
func lookPath(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	return "", ErrMissing
}

// Start starts etcd and the three nodes, bootstraps the cluster on n1 and
// waits until both replicas stream from it.
func Start(ctx context.Context) (*Cluster, error) {
	etcdBin, err := lookPath("etcd")
	if err != nil {
		return nil, err
	}
	patroniBin, err := lookPath("patroni")
	if err != nil {
		return nil, err
	}
	bin, err := pgcluster.BinDir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "pgfence-patroni-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{dir: dir, scope: "pgfence", http: &http.Client{Timeout: 2 * time.Second}}
	ok := false
	defer func() {
		if !ok {
			_ = c.Close()
		}
	}()
	ports := make([]int, 2+2*Nodes)
	for i := range ports {
		if ports[i], err = unpriv.FreePort(); err != nil {
			return nil, err
		}
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	for i := range Nodes {
		n := &Node{Name: fmt.Sprintf("n%d", i+1), Port: ports[2+2*i], rest: ports[3+2*i], c: c}
		n.data = filepath.Join(dir, n.Name, "data")
		n.conf = filepath.Join(dir, n.Name, "patroni.yml")
		if err := os.MkdirAll(filepath.Dir(n.data), 0o700); err != nil {
			return nil, err
		}
		if err := os.WriteFile(n.conf, []byte(n.config(bin, ports[0])), 0o600); err != nil {
			return nil, err
		}
		n.patroniBin = patroniBin
		c.nodes[i] = n
	}
	if err := os.MkdirAll(filepath.Join(dir, "etcd"), 0o700); err != nil {
		return nil, err
	}
	if err := unpriv.Own(dir); err != nil {
		return nil, err
	}
	c.etcd = unpriv.Command(etcdBin, "--name", "e1", "--data-dir", filepath.Join(dir, "etcd", "data"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "e1="+peerURL, "--enable-v2=true")
	if c.etcdDone, err = srvproc.StartLogged(c.etcd, filepath.Join(dir, "etcd.log")); err != nil {
		return nil, err
	}
	if err := c.poll(ctx, 30*time.Second, "etcd to answer", func() (bool, error) {
		resp, err := c.http.Get(etcdURL + "/health")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	}); err != nil {
		return nil, err
	}
	// n1 bootstraps; the others join once it leads, so the bootstrap is
	// always n1's.
	if err := c.nodes[0].Start(); err != nil {
		return nil, err
	}
	if _, err := c.WaitLeader(ctx, 60*time.Second); err != nil {
		return nil, err
	}
	for _, n := range c.nodes[1:] {
		if err := n.Start(); err != nil {
			return nil, err
		}
	}
	if err := c.WaitReplicas(ctx, 90*time.Second, Nodes-1); err != nil {
		return nil, err
	}
	ok = true
	return c, nil
}

// config is the node's patroni.yml.
func (n *Node) config(bin string, etcdPort int) string {
	dir := filepath.Dir(n.data)
	return fmt.Sprintf(`scope: %[1]s
name: %[2]s
log:
  level: INFO
restapi:
  listen: 127.0.0.1:%[3]d
  connect_address: 127.0.0.1:%[3]d
etcd:
  host: 127.0.0.1:%[4]d
bootstrap:
  dcs:
    ttl: %[5]d
    loop_wait: %[6]d
    retry_timeout: 5
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_log_hints: 'on'
        wal_keep_size: 128MB
        max_connections: 100
  initdb:
  - encoding: UTF8
  - auth: trust
postgresql:
  listen: 127.0.0.1:%[7]d
  connect_address: 127.0.0.1:%[7]d
  data_dir: %[8]s
  bin_dir: %[9]s
  pgpass: %[10]s/pgpass
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
    rewind:
      username: postgres
  parameters:
    unix_socket_directories: %[10]s
    fsync: 'off'
  basebackup:
  - checkpoint: fast
  pg_hba:
  - host all all 127.0.0.1/32 trust
  - host replication all 127.0.0.1/32 trust
  - local all all trust
`, n.c.scope, n.Name, n.rest, etcdPort, int(TTL/time.Second), int(LoopWait/time.Second), n.Port, n.data, bin, dir)
}

// Node returns node i (0, 1 or 2).
func (c *Cluster) Node(i int) *Node { return c.nodes[i] }

// Others returns every node but n, in order.
func (c *Cluster) Others(n *Node) []*Node {
	var out []*Node
	for _, x := range c.nodes {
		if x != n {
			out = append(out, x)
		}
	}
	return out
}

// URL is the multi-host URL an application on Patroni uses: every node,
// the read-write one chosen at connect time.
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

// Member is a node as Patroni's REST API reports it.
type Member struct {
	Name     string `json:"name"`
	Role     string `json:"role"`
	State    string `json:"state"`
	Timeline int64  `json:"timeline"`
}

// Members asks the first node that answers for the cluster's members.
func (c *Cluster) Members() ([]Member, error) {
	var last error = errors.New("patroni: no node answered")
	for _, n := range c.nodes {
		resp, err := c.http.Get(fmt.Sprintf("http://127.0.0.1:%d/cluster", n.rest))
		if err != nil {
			last = err
			continue
		}
		var body struct {
			Members []Member `json:"members"`
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil {
			last = err
			continue
		}
		return body.Members, nil
	}
	return nil, last
}

// WaitLeader waits until a node leads and its PostgreSQL is running, and
// returns it.
func (c *Cluster) WaitLeader(ctx context.Context, within time.Duration, except ...*Node) (*Node, error) {
	var leader *Node
	err := c.poll(ctx, within, "a leader", func() (bool, error) {
		ms, err := c.Members()
		if err != nil {
			return false, nil
		}
		for _, m := range ms {
			if m.Role == "leader" && m.State == "running" {
				n := c.byName(m.Name)
				for _, x := range except {
					if x == n {
						n = nil
					}
				}
				if n != nil && n.writable(ctx) {
					leader = n
					return true, nil
				}
			}
		}
		return false, nil
	})
	return leader, err
}

// WaitReplicas waits until want nodes stream from the leader and have
// replayed everything it had written when the wait began.
func (c *Cluster) WaitReplicas(ctx context.Context, within time.Duration, want int) error {
	leader, err := c.WaitLeader(ctx, within)
	if err != nil {
		return err
	}
	lsn, err := leader.psql(ctx, "SELECT pg_current_wal_lsn()")
	if err != nil {
		return err
	}
	lsn = strings.TrimSpace(lsn)
	return c.poll(ctx, within, fmt.Sprintf("%d replicas streaming from %s", want, leader.Name), func() (bool, error) {
		got := 0
		for _, n := range c.nodes {
			if n == leader {
				continue
			}
			out, err := n.psql(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming' AND sender_port = %d)
  AND pg_last_wal_replay_lsn() >= '%s'::pg_lsn`, leader.Port, lsn))
			if err == nil && strings.TrimSpace(out) == "t" {
				got++
			}
		}
		return got >= want, nil
	})
}

func (c *Cluster) byName(name string) *Node {
	for _, n := range c.nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// writable reports whether the node's PostgreSQL accepts writes now.
func (n *Node) writable(ctx context.Context) bool {
	out, err := n.psql(ctx, "SELECT NOT pg_is_in_recovery()")
	return err == nil && strings.TrimSpace(out) == "t"
}

// Timeline returns the node's current timeline, read as pgfence reads it.
func (n *Node) Timeline(ctx context.Context) (int64, error) {
	out, err := n.psql(ctx, "SELECT ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::bigint")
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(out), 10, 64)
}

func (n *Node) psql(ctx context.Context, sql string) (string, error) {
	out, err := srvproc.PSQL(ctx, n.URL(), sql)
	if err != nil {
		return "", fmt.Errorf("%s: %w", n.Name, err)
	}
	return out, nil
}

func (c *Cluster) poll(ctx context.Context, within time.Duration, what string, done func() (bool, error)) error {
	if err := srvproc.Poll(ctx, within, what, c.dir, done); err != nil {
		return fmt.Errorf("patroni: %w", err)
	}
	return nil
}

// Start starts the node's Patroni, which starts (or rejoins with
// pg_rewind, or bootstraps) its PostgreSQL.
func (n *Node) Start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.patroni != nil {
		return fmt.Errorf("patroni: %s is running", n.Name)
	}
	cmd := unpriv.Command(n.patroniBin, n.conf)
	done, err := srvproc.StartLogged(cmd, filepath.Join(filepath.Dir(n.data), "patroni.log"))
	if err != nil {
		return err
	}
	n.patroni, n.waitDone = cmd, done
	return nil
}

// Crash kills the node's Patroni and its PostgreSQL (every process of the
// server) with SIGKILL: a machine that died.
func (n *Node) Crash() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.patroni != nil {
		_ = syscall.Kill(-n.patroni.Process.Pid, syscall.SIGKILL)
		<-n.waitDone
		n.patroni = nil
	}
	return srvproc.KillPostmaster(n.data)
}

// Freeze stops the node's Patroni (SIGSTOP): its PostgreSQL goes on as it
// was (a primary keeps accepting writes, a replica keeps following the
// primary it had), but the node takes no part in elections.
func (n *Node) Freeze() error { return n.signalPatroni(syscall.SIGSTOP) }

// Thaw resumes a frozen Patroni (SIGCONT).
func (n *Node) Thaw() error { return n.signalPatroni(syscall.SIGCONT) }

func (n *Node) signalPatroni(sig syscall.Signal) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.patroni == nil {
		return fmt.Errorf("patroni: %s is not running", n.Name)
	}
	return syscall.Kill(-n.patroni.Process.Pid, sig)
}

// StallSending stops (SIGSTOP) the WAL senders of this node, a primary:
// its commits go on (replication is asynchronous) while its replicas fall
// behind, so a crash of the node loses the WAL they did not get. (Stopping
// the replicas' WAL receivers instead loses nothing: what the primary had
// sent waits in their sockets' buffers.) A crash ends the stopped senders.
func (n *Node) StallSending() error { return n.signalChildren("walsender", syscall.SIGSTOP) }

// signalChildren sends sig to the postmaster's children whose title
// matches pattern.
func (n *Node) signalChildren(pattern string, sig syscall.Signal) error {
	b, err := os.ReadFile(filepath.Join(n.data, "postmaster.pid"))
	if err != nil {
		return err
	}
	pm := strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0])
	out, err := exec.Command("pgrep", "-P", pm, "-f", pattern).Output()
	if err != nil {
		return fmt.Errorf("patroni: no %s process on %s", pattern, n.Name)
	}
	for _, f := range strings.Fields(string(out)) {
		pid, _ := strconv.Atoi(f)
		if err := syscall.Kill(pid, sig); err != nil {
			return err
		}
	}
	return nil
}

// Switchover asks Patroni for a planned switchover from leader to candidate.
func (c *Cluster) Switchover(leader, candidate *Node) error {
	body, _ := json.Marshal(map[string]string{"leader": leader.Name, "candidate": candidate.Name})
	resp, err := (&http.Client{Timeout: 60 * time.Second}).Post(fmt.Sprintf("http://127.0.0.1:%d/switchover", leader.rest),
		"application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var msg bytes.Buffer
	_, _ = msg.ReadFrom(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("patroni: switchover %s -> %s: %s: %s", leader.Name, candidate.Name, resp.Status, msg.String())
	}
	return nil
}

// Logs returns the tail of the node's Patroni and PostgreSQL logs.
func (n *Node) Logs() string {
	b, _ := os.ReadFile(filepath.Join(filepath.Dir(n.data), "patroni.log"))
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// Close kills every process and removes the cluster's files.
func (c *Cluster) Close() error {
	for _, n := range c.nodes {
		if n != nil {
			_ = n.Thaw()
			_ = n.Crash()
		}
	}
	if c.etcd != nil && c.etcd.Process != nil {
		_ = syscall.Kill(-c.etcd.Process.Pid, syscall.SIGKILL)
		<-c.etcdDone
	}
	if os.Getenv("PGFENCE_KEEP_PATRONI") != "" {
		return nil
	}
	return os.RemoveAll(c.dir)
}
