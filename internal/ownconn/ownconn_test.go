package ownconn_test

import (
	"context"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/ownconn"
	"github.com/pgfence/pgfence/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// A multi-host URL whose first host accepts connections and never answers
// (a frozen server during a failover) and whose second is the test server:
// Dial connects within a deadline shorter than the hung host's
// connect_timeout, which pgx's one-host-after-another connect cannot.
func TestDialGetsPastAHungHost(t *testing.T) {
	hung, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close()
	u, err := url.Parse(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	live := u.Host
	if u.Port() == "" {
		live += ":5432"
	}
	u.Host = hung.Addr().String() + "," + live
	q := u.Query()
	q.Set("connect_timeout", "30")
	q.Set("target_session_attrs", "read-write")
	u.RawQuery = q.Encode()
	cfg, err := pgx.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := pgx.ConnectConfig(ctx, cfg.Copy()); err == nil {
		t.Fatal("pgx connected past the hung host within the deadline; the test proves nothing")
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel2()
	conn, err := ownconn.Dial(ctx2, cfg)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer conn.Close(context.Background())
	var one int
	if err := conn.QueryRow(ctx2, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("query on the dialled connection: %d, %v", one, err)
	}
}
