// Package netns puts test processes on a network of their own and cuts it
// the way a partition does: no proxy, the process's own kernel drops,
// retransmits and resets, as in production.
//
// A Host is a Linux network namespace joined to the test's namespace by a
// veth pair, a /30 of 10.213.0.0/16 on its two ends. A server the test runs
// listens on the host end (Gateway); a process started with Host.Command
// reaches it at that address, through the namespace's own link. Faults are
// nftables rules inside the namespace, on traffic to and from Gateway only:
//
//   - DropBoth: a black hole, both ways; the client's writes retransmit
//     into the void and nothing comes back.
//   - DropRequests: the client's packets are lost; the server sees nothing.
//   - DropReplies: the server receives and executes; its answers are lost.
//   - Reset: every packet the server sends is refused with a TCP reset, so
//     the server's kernel resets the connection (on this kernel a reset sent
//     from the namespace's output chain resets neither end).
//
// Heal removes the rules. Traffic goes only to addresses of links the
// package made. Close deletes the namespace, which removes its link too; a
// namespace left by a test process that was killed is removed by the next
// New (namespaces are named after the process that made them).
//
// It needs root, iproute2 and nftables; without them New returns an error
// matching ErrUnavailable that says how to install them.
package netns

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// ErrUnavailable is returned by New where network namespaces cannot be made:
// not root, or ip (iproute2) or nft (nftables) missing.
var ErrUnavailable = errors.New("netns: network partition tests need root, iproute2 and nftables " +
	"(Debian: apt-get install iproute2 nftables; run the tests as root)")

// Fault is one way of cutting a host off.
type Fault int

// The faults Cut makes.
const (
	DropBoth     Fault = iota // a black hole: nothing passes either way
	DropRequests              // the client's packets are lost
	DropReplies               // the server's packets are lost: it executes, its answers never arrive
	Reset                     // the server's packets are refused with a reset: connections break
)

// String names the fault (drop-both, drop-requests, drop-replies, reset).
func (f Fault) String() string {
	switch f {
	case DropBoth:
		return "drop-both"
	case DropRequests:
		return "drop-requests"
	case DropReplies:
		return "drop-replies"
	case Reset:
		return "reset"
	}
	return "fault(" + strconv.Itoa(int(f)) + ")"
}

// Faults are all the faults, for tests that try each.
var Faults = []Fault{DropBoth, DropRequests, DropReplies, Reset}

// prefix names every namespace the package makes: prefix + owner PID + "-"
// + n; linkPrefix its links: linkPrefix + owner PID in hex + "-" + n in hex.
const (
	prefix     = "pgfence-"
	linkPrefix = "pgf"
)

// Host is a network namespace with a link to the test's namespace.
type Host struct {
	// Name is the namespace's name.
	Name string
	// Addr is the host's own address (inside the namespace).
	Addr netip.Addr
	// Gateway is the address of the link's other end, in the test's
	// namespace: where a server listens for this host's processes.
	Gateway netip.Addr

	mu     sync.Mutex
	closed bool
}

var (
	seqMu sync.Mutex
	seq   int
)

// Available reports whether hosts can be made here: nil, or an error
// matching ErrUnavailable.
func Available() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: not running as root", ErrUnavailable)
	}
	for _, tool := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%w: %s not found", ErrUnavailable, tool)
		}
	}
	return nil
}

// New makes a host: a namespace, a veth pair with a free /30 on its ends,
// and an empty nftables table for Cut. It first removes the namespaces that
// processes no longer running left behind.
func New() (*Host, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	sweep()
	seqMu.Lock()
	seq++
	n := seq
	seqMu.Unlock()
	pid := os.Getpid()
	h := &Host{Name: fmt.Sprintf("%s%d-%d", prefix, pid, n)}
	// Interface names have at most 15 bytes: "pgf", the PID (at most 6 hex
	// digits: pid_max is 2^22), "-", n (4), and "n" for the namespace end,
	// which is renamed once it is inside its namespace.
	outer := fmt.Sprintf("%s%x-%x", linkPrefix, pid, n%(1<<16))
	inner := outer + "n"

	unlock, err := lockAddrs()
	if err != nil {
		return nil, err
	}
	defer unlock()
	gw, addr, err := freeSubnet()
	if err != nil {
		return nil, err
	}
	h.Gateway, h.Addr = gw, addr
	steps := [][]string{
		{"ip", "netns", "add", h.Name},
		{"ip", "link", "add", outer, "type", "veth", "peer", "name", inner},
		{"ip", "link", "set", inner, "netns", h.Name},
		{"ip", "addr", "add", gw.String() + "/30", "dev", outer},
		{"ip", "link", "set", outer, "up"},
		{"ip", "-n", h.Name, "link", "set", inner, "name", "eth0"},
		{"ip", "-n", h.Name, "addr", "add", addr.String() + "/30", "dev", "eth0"},
		{"ip", "-n", h.Name, "link", "set", "eth0", "up"},
		{"ip", "-n", h.Name, "link", "set", "lo", "up"},
	}
	for _, s := range steps {
		if err := run(s...); err != nil {
			_ = h.Close()
			_ = run("ip", "link", "del", outer) // if the namespace never got its end
			return nil, err
		}
	}
	if err := h.nft(nftTable); err != nil {
		_ = h.Close()
		return nil, err
	}
	return h, nil
}

// nftTable is the namespace's (empty) rule set: an input and an output chain
// that Cut fills and Heal flushes.
const nftTable = `table inet pgfence {
	chain in { type filter hook input priority 0; policy accept; }
	chain out { type filter hook output priority 0; policy accept; }
}`

// Command returns a command that runs path inside the host's namespace (ip
// netns exec execs in place: the command's PID is the program's). It is
// killed if the process that started it dies.
func (h *Host) Command(path string, args ...string) *exec.Cmd {
	cmd := exec.Command("ip", append([]string{"netns", "exec", h.Name, path}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// Cut makes fault on the host's traffic with its gateway, on top of any
// fault already made.
func (h *Host) Cut(f Fault) error {
	gw := h.Gateway.String()
	var rules []string
	switch f {
	case DropBoth:
		rules = []string{"add rule inet pgfence out ip daddr " + gw + " drop",
			"add rule inet pgfence in ip saddr " + gw + " drop"}
	case DropRequests:
		rules = []string{"add rule inet pgfence out ip daddr " + gw + " drop"}
	case DropReplies:
		rules = []string{"add rule inet pgfence in ip saddr " + gw + " drop"}
	case Reset:
		rules = []string{"add rule inet pgfence in ip saddr " + gw + " tcp flags & rst == 0 reject with tcp reset"}
	default:
		return fmt.Errorf("netns: unknown fault %d", int(f))
	}
	return h.nft(strings.Join(rules, "\n"))
}

// Heal removes every fault: packets flow again (connections the fault did
// not end carry on, their lost packets retransmitted).
func (h *Host) Heal() error {
	return h.nft("flush chain inet pgfence in\nflush chain inet pgfence out")
}

// Close deletes the namespace and with it its link and rules. Processes
// still running in it keep it alive until they end: stop them first.
func (h *Host) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil
	}
	h.closed = true
	return run("ip", "netns", "del", h.Name)
}

// nft applies a rule set inside the namespace.
func (h *Host) nft(rules string) error {
	cmd := exec.Command("ip", "netns", "exec", h.Name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("netns: nft in %s: %v: %s", h.Name, err, bytes.TrimSpace(out))
	}
	return nil
}

// sweep deletes the namespaces of processes that are gone (a test killed
// before its cleanup ran), and the links such a process made but never
// moved into a namespace.
func sweep() {
	if out, err := exec.Command("ip", "netns", "list").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
			rest, ok := strings.CutPrefix(name, prefix)
			if !ok {
				continue
			}
			pidText, _, _ := strings.Cut(rest, "-")
			if pid, err := strconv.Atoi(pidText); err == nil && !alive(pid) {
				_ = run("ip", "netns", "del", name)
			}
		}
	}
	if out, err := exec.Command("ip", "-o", "link", "show", "type", "veth").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			// "7: pgf1a2b-1@if6: <...>"
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
			rest, ok := strings.CutPrefix(name, linkPrefix)
			if !ok {
				continue
			}
			pidText, _, _ := strings.Cut(rest, "-")
			if pid, err := strconv.ParseInt(pidText, 16, 32); err == nil && !alive(int(pid)) {
				_ = run("ip", "link", "del", name)
			}
		}
	}
}

// alive reports whether process pid exists.
func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// base is the range hosts' subnets are taken from.
var base = netip.MustParsePrefix("10.213.0.0/16")

// freeSubnet returns the two usable addresses of a /30 of base that
// overlaps no address and no route of the test's namespace (a VPN's or a
// container network's route into the range included).
func freeSubnet() (gw, addr netip.Addr, err error) {
	var used []netip.Prefix
	for _, args := range [][]string{{"-o", "-4", "addr", "show"}, {"-4", "route", "show", "table", "all"}} {
		out, err := exec.Command("ip", args...).Output()
		if err != nil {
			return gw, addr, fmt.Errorf("netns: ip %s: %w", strings.Join(args, " "), err)
		}
		for _, f := range strings.Fields(string(out)) {
			if p, err := netip.ParsePrefix(f); err == nil && p.Addr().Is4() {
				used = append(used, p.Masked())
			} else if a, err := netip.ParseAddr(f); err == nil && a.Is4() {
				used = append(used, netip.PrefixFrom(a, 32))
			}
		}
	}
	start := base.Addr().As4()
	for i := range 1 << 14 {
		// Start from an offset of the PID so that processes rarely probe
		// the same subnets.
		k := (i + os.Getpid()) % (1 << 14)
		b := start
		b[2] = byte(k >> 6)
		b[3] = byte(k&63) << 2
		cand := netip.PrefixFrom(netip.AddrFrom4(b), 30)
		if !slices.ContainsFunc(used, cand.Overlaps) {
			gw = cand.Addr().Next()
			return gw, gw.Next(), nil
		}
	}
	return gw, addr, errors.New("netns: no free /30 left in " + base.String())
}

// lockAddrs serialises the choice of a subnet among the processes of one
// machine (go test runs packages in parallel).
func lockAddrs() (func(), error) {
	f, err := os.OpenFile(filepath.Join(os.TempDir(), "pgfence-netns.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		_ = f.Close()
		return nil, err
	}
	return func() { _ = f.Close() }, nil
}

func run(args ...string) error {
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		return fmt.Errorf("netns: %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}
