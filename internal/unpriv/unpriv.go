// Package unpriv runs test servers that refuse to run as root (PostgreSQL,
// PgBouncer): as root, they run as nobody, in directories nobody owns.
package unpriv

import (
	"fmt"
	"net"
	"os"
	"os/exec"
)

// Command returns a command for path that runs as nobody when we are root.
func Command(path string, args ...string) *exec.Cmd {
	if os.Geteuid() == 0 {
		return exec.Command("setpriv", append([]string{"--reuid=nobody", "--regid=nogroup", "--clear-groups", "--", path}, args...)...)
	}
	return exec.Command(path, args...)
}

// Own gives dir (recursively) to nobody when we are root, so a Command can
// write in it.
func Own(dir string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	if out, err := exec.Command("chown", "-R", "nobody", dir).CombinedOutput(); err != nil {
		return fmt.Errorf("chown %s: %v: %s", dir, err, out)
	}
	return nil
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
