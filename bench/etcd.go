package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// etcdServer is the single etcd member the bench runs: Debian's
// etcd-server, its data on disk, fsync on (etcd syncs its WAL at every
// commit unless told --unsafe-no-fsync, which the bench does not).
type etcdServer struct {
	cmd *exec.Cmd
	dir string
	url string
	cli *clientv3.Client
}

// errNoEtcd names what to install when etcd is not on PATH.
var errNoEtcd = errors.New("etcd is not on PATH (Debian: apt-get install etcd-server)")

func startEtcd(ctx context.Context) (*etcdServer, error) {
	bin, err := exec.LookPath("etcd")
	if err != nil {
		return nil, errNoEtcd
	}
	dir, err := os.MkdirTemp("/var/tmp", "pgfence-bench-etcd-")
	if err != nil {
		return nil, err
	}
	cu, pu := "http://127.0.0.1:"+strconv.Itoa(freePort()), "http://127.0.0.1:"+strconv.Itoa(freePort())
	cmd := exec.Command(bin, "--name", "bench", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", cu, "--advertise-client-urls", cu,
		"--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu, "--initial-cluster", "bench="+pu)
	log, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	e := &etcdServer{cmd: cmd, dir: dir, url: cu}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		res, err := http.Get(cu + "/health")
		if err == nil {
			res.Body.Close()
			if res.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			e.stop()
			return nil, fmt.Errorf("etcd did not become healthy within 20s (its log: %s)", log.Name())
		}
	}
	if e.cli, err = clientv3.New(clientv3.Config{Endpoints: []string{cu}, DialTimeout: 5 * time.Second}); err != nil {
		e.stop()
		return nil, err
	}
	return e, nil
}

func (e *etcdServer) stop() {
	if e.cli != nil {
		_ = e.cli.Close()
	}
	_ = e.cmd.Process.Kill()
	_ = e.cmd.Wait()
	_ = os.RemoveAll(e.dir)
}

func (e *etcdServer) version(ctx context.Context) string {
	st, err := e.cli.Status(ctx, e.url)
	if err != nil {
		return "?"
	}
	return st.Version
}

func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

const etcdForm = "etcd `concurrency.Mutex` TryLock / Unlock"

// etcdPairs is the pairs table's etcd form: each client has its own
// session (an etcd lease with a 15 s TTL, kept alive) and mutex; a pair is
// a TryLock that got the lock and its Unlock.
func (b *bench) etcdPairs(ctx context.Context, client int, shared bool) (op, func(), error) {
	s, err := concurrency.NewSession(b.etcd.cli, concurrency.WithTTL(15))
	if err != nil {
		return nil, nil, err
	}
	m := concurrency.NewMutex(s, "/pgfence-bench/"+leaseName(client, shared))
	return func(ctx context.Context) (bool, error) {
		if err := m.TryLock(ctx); errors.Is(err, concurrency.ErrLocked) {
			return false, nil
		} else if err != nil {
			return false, err
		}
		return true, m.Unlock(ctx)
	}, func() { _ = s.Close() }, nil
}

// etcdHandovers measures Unlock to the waiting Lock returning in another
// session, n times.
func (b *bench) etcdHandovers(ctx context.Context, n int) ([]time.Duration, error) {
	var ms [2]*concurrency.Mutex
	for i := range ms {
		s, err := concurrency.NewSession(b.etcd.cli, concurrency.WithTTL(15))
		if err != nil {
			return nil, err
		}
		defer s.Close()
		ms[i] = concurrency.NewMutex(s, "/pgfence-bench/handover")
	}
	if err := ms[0].Lock(ctx); err != nil {
		return nil, err
	}
	lat := make([]time.Duration, 0, n)
	for i := range n {
		held, next := ms[i%2], ms[(i+1)%2]
		got := make(chan error, 1)
		var at time.Time
		go func() { err := next.Lock(ctx); at = time.Now(); got <- err }()
		time.Sleep(20 * time.Millisecond) // the waiter is waiting
		released := time.Now()
		if err := held.Unlock(ctx); err != nil {
			return nil, err
		}
		if err := <-got; err != nil {
			return nil, err
		}
		lat = append(lat, at.Sub(released))
	}
	_ = ms[n%2].Unlock(ctx)
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return lat, nil
}

// etcdCrash kills (SIGKILL) a child process holding an etcd mutex with a
// session TTL of ttl while this process's Lock waits for it, rounds times,
// and returns the takeover times after the kill, in ms. It checks that the
// new holder's revision (etcd's fencing value) is above the old one's.
func (b *bench) etcdCrash(ctx context.Context, rounds int, ttl time.Duration) ([]float64, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	s, err := concurrency.NewSession(b.etcd.cli, concurrency.WithTTL(15))
	if err != nil {
		return nil, err
	}
	defer s.Close()
	var takeover []float64
	for i := range rounds {
		key := fmt.Sprintf("/pgfence-bench/crash-%d", i)
		cmd, line, err := startChild(ctx, exe, "-etcd-child", key, "-etcd-url", b.etcd.url, "-crash-ttl", ttl.String())
		if err != nil {
			return nil, err
		}
		var old int64
		if _, err := fmt.Sscanf(line, "held %d", &old); err != nil {
			return nil, fmt.Errorf("etcd crash child said %q: %w", line, err)
		}
		m := concurrency.NewMutex(s, key)
		got := make(chan error, 1)
		var at time.Time
		go func() { err := m.Lock(ctx); at = time.Now(); got <- err }()
		time.Sleep(300*time.Millisecond + rand.N(ttl/3))
		killed := time.Now()
		if err := cmd.Process.Kill(); err != nil {
			return nil, err
		}
		_ = cmd.Wait()
		if err := <-got; err != nil {
			return nil, err
		}
		if rev := m.Header().Revision; rev <= old {
			return nil, fmt.Errorf("etcd crash: the new holder's revision %d is not above the crashed holder's %d", rev, old)
		}
		takeover = append(takeover, float64(at.Sub(killed).Microseconds())/1000)
		if err := m.Unlock(ctx); err != nil {
			return nil, err
		}
	}
	return takeover, nil
}

// etcdChildFlags are the hidden flags of the etcd crash child.
func etcdChildFlags() (key, url *string) {
	return flag.String("etcd-child", "", "internal: hold this etcd mutex until killed"),
		flag.String("etcd-url", "", "internal: the etcd crash child's endpoint")
}

// etcdChild locks key with a session of TTL ttl, prints "held REVISION"
// and waits to be killed.
func etcdChild(ctx context.Context, url, key string, ttl time.Duration) error {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{url}, DialTimeout: 5 * time.Second})
	if err != nil {
		return err
	}
	s, err := concurrency.NewSession(cli, concurrency.WithTTL(int(ttl.Seconds())))
	if err != nil {
		return err
	}
	m := concurrency.NewMutex(s, key)
	if err := m.Lock(ctx); err != nil {
		return err
	}
	fmt.Printf("held %d\n", m.Header().Revision)
	select {}
}
