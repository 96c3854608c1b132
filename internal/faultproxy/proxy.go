package faultproxy

import (
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Mode is what the proxy does with traffic.
type Mode int

const (
	// Pass forwards traffic unchanged.
	Pass Mode = iota
	// Blackhole keeps connections open but forwards nothing, in either
	// direction; new connections are accepted and hang.
	Blackhole
	// Reset closes every connection and refuses new ones.
	Reset
	// HoldReplies forwards what clients send but holds what the server
	// answers (until the mode changes): a request that arrives and whose
	// reply is lost on the way back.
	HoldReplies
)

// Proxy forwards connections from Addr to a target address.
type Proxy struct {
	ln     net.Listener
	target string

	mu       sync.Mutex
	cond     *sync.Cond
	mode     Mode
	delay    time.Duration
	onCommit func() (CommitFault, time.Duration)
	// commitsOn: what else CommitsOn counts as a commit
	commitsOn func(query string) bool
	commits   map[CommitFault]int
	conns     map[net.Conn]struct{}
	held      int // chunks that reached a held direction
	done      bool
	wg        sync.WaitGroup
}

// New starts a proxy on 127.0.0.1 (a free port) forwarding to target.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		ln:      ln,
		target:  target,
		commits: make(map[CommitFault]int),
		conns:   make(map[net.Conn]struct{}),
	}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the host:port clients should connect to.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Set switches the mode; Reset also closes every open connection.
func (p *Proxy) Set(m Mode) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode = m
	if m == Reset {
		for c := range p.conns {
			reset(c)
		}
	}
	p.cond.Broadcast()
}

// Held is how many chunks of traffic have reached the proxy while their
// direction was held (Blackhole, HoldReplies): a test waits on it to know
// that a request is stuck.
func (p *Proxy) Held() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held
}

// SetDelay adds d of latency to every chunk forwarded (0 removes it).
func (p *Proxy) SetDelay(d time.Duration) {
	p.mu.Lock()
	p.delay = d
	p.mu.Unlock()
}

// Close stops the proxy, closes every connection (half-open ones too) and
// waits for the proxy's goroutines (a LateCommit not yet forwarded never is).
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.done = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.cond.Broadcast()
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.done || p.mode == Reset {
			p.mu.Unlock()
			_ = c.Close()
			continue
		}
		p.conns[c] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go p.serve(c)
	}
}

func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	defer p.forget(client)
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		_ = client.Close()
		return
	}
	p.mu.Lock()
	if p.done {
		p.mu.Unlock()
		_ = server.Close()
		_ = client.Close()
		return
	}
	p.conns[server] = struct{}{}
	p.mu.Unlock()
	defer p.forget(server)
	l := newLink(p, client, server)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); l.requests() }()
	go func() { defer wg.Done(); l.replies() }()
	wg.Wait()
}

func (p *Proxy) forget(c net.Conn) {
	_ = c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// reset closes c with an RST rather than a FIN (SO_LINGER 0), as a proxy or
// NAT that drops a connection does.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

// gate blocks while the proxy holds traffic in this direction (reply: from
// the server) and reports whether to go on.
func (p *Proxy) gate(reply bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if (p.mode == Blackhole || p.mode == HoldReplies && reply) && !p.done {
		p.held++
	}
	for (p.mode == Blackhole || p.mode == HoldReplies && reply) && !p.done {
		p.cond.Wait()
	}
	return !p.done && p.mode != Reset
}

// gated reads from a connection through the proxy's gate and delay: data read
// waits while its direction is held and is delayed when a delay is set.
type gated struct {
	p     *Proxy
	c     net.Conn
	reply bool // the connection is the server's
}

func (g gated) Read(b []byte) (int, error) {
	n, err := g.c.Read(b)
	if n > 0 {
		if !g.p.gate(g.reply) {
			return 0, net.ErrClosed
		}
		g.p.mu.Lock()
		d := g.p.delay
		g.p.mu.Unlock()
		if d > 0 {
			time.Sleep(d)
		}
	}
	return n, err
}

// To starts a proxy in front of the server a PostgreSQL URL names (its
// first host), for Route.
func To(url string) (*Proxy, error) {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	return New(net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
}

// Route points a connection config (a pool's ConnConfig.Config) at the
// proxy, and at it only.
func (p *Proxy) Route(cfg *pgconn.Config) {
	host, port, _ := net.SplitHostPort(p.Addr())
	n, _ := strconv.Atoi(port)
	cfg.Host, cfg.Port, cfg.Fallbacks = host, uint16(n), nil
}
