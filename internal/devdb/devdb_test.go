package devdb

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// childEnv makes the test binary a caller that starts a server and waits
// to be killed.
const childEnv = "PGFENCE_DEVDB_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		srv, err := Start(context.Background(), Options{})
		if err != nil {
			fmt.Println("ERR", err)
			os.Exit(1)
		}
		fmt.Println("URL", srv.URL)
		time.Sleep(time.Hour) // until killed
		return
	}
	os.Exit(m.Run())
}

// A caller killed outright (SIGKILL: no Close) takes its throwaway server
// with it: the server stops answering and its files, the helper's own
// binary included, are removed.
func TestAServerGoesWithAKilledCaller(t *testing.T) {
	if _, err := BinDir(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skipf("skipped: %v", err)
	}
	// A TMPDIR like /tmp: as root, the server and its helper run as
	// nobody, who must reach it and remove what it made there.
	tmp := t.TempDir()
	if err := os.Chmod(filepath.Dir(tmp), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(tmp, 0o1777); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "TMPDIR="+tmp)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	var addr string
	select {
	case l := <-lines:
		u, ok := strings.CutPrefix(l, "URL ")
		if !ok {
			t.Fatalf("the caller said %q, want its server's URL", l)
		}
		pu, err := url.Parse(u)
		if err != nil {
			t.Fatal(err)
		}
		addr = pu.Host
	case <-time.After(3 * time.Minute):
		t.Fatal("no server within 3 minutes")
	}
	if c, err := net.DialTimeout("tcp", addr, 5*time.Second); err != nil {
		t.Fatalf("the server at %s does not answer while its caller lives: %v", addr, err)
	} else {
		_ = c.Close()
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	deadline := time.Now().Add(time.Minute)
	for {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err == nil {
			_ = c.Close()
		}
		left, rerr := os.ReadDir(tmp)
		if err != nil && rerr == nil && len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("a minute after its caller was killed: server answers %v, %d entries left in TMPDIR", err == nil, len(left))
		}
		time.Sleep(100 * time.Millisecond)
	}
}
