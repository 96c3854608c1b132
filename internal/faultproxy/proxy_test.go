package faultproxy

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"
)

// echo serves lines back on a local listener.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String()
}

func TestModes(t *testing.T) {
	p, err := New(echo(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	roundTrip := func(msg string, within time.Duration) (string, error) {
		_ = c.SetDeadline(time.Now().Add(within))
		if _, err := c.Write([]byte(msg + "\n")); err != nil {
			return "", err
		}
		return r.ReadString('\n')
	}
	if got, err := roundTrip("pass", time.Second); err != nil || got != "pass\n" {
		t.Fatalf("pass: %q %v", got, err)
	}
	if p.Held() != 0 {
		t.Fatalf("Held = %d with nothing held", p.Held())
	}
	p.Set(Blackhole)
	if got, err := roundTrip("hole", 200*time.Millisecond); err == nil {
		t.Fatalf("blackhole let %q through", got)
	}
	if p.Held() == 0 {
		t.Fatal("Held = 0 after the blackhole held a message")
	}
	p.Set(Pass) // held data flows again
	_ = c.SetDeadline(time.Now().Add(time.Second))
	if got, err := r.ReadString('\n'); err != nil || got != "hole\n" {
		t.Fatalf("after blackhole: %q %v", got, err)
	}
	p.SetDelay(100 * time.Millisecond)
	start := time.Now()
	if got, err := roundTrip("slow", 2*time.Second); err != nil || got != "slow\n" || time.Since(start) < 150*time.Millisecond {
		t.Fatalf("delay: %q %v after %v", got, err, time.Since(start))
	}
	p.SetDelay(0)
	p.Set(Reset)
	if _, err := roundTrip("reset", time.Second); err == nil {
		t.Fatal("connection survived a reset")
	}
	if c2, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		_ = c2.SetDeadline(time.Now().Add(time.Second))
		_, _ = c2.Write([]byte("x\n"))
		if _, err := bufio.NewReader(c2).ReadString('\n'); err == nil {
			t.Fatal("a new connection was served while resetting")
		}
		_ = c2.Close()
	}
}
