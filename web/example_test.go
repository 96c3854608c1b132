package web_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/pgfence/pgfence/lock"
	"github.com/pgfence/pgfence/pgfencetest"
	"github.com/pgfence/pgfence/web"
)

// Mount the status page in the application's own mux, under /pgfence/,
// read-only. With AllowActions it also offers force release, run now,
// pause and resume; Identity names the application's user in the log and
// the ledger.
func Example() {
	ctx := context.Background()
	// A fresh schema on $PGFENCE_TEST_DATABASE_URL (or TEST_DATABASE_URL,
	// DATABASE_URL), dropped at the end. In a program: the client your
	// runner uses.
	db, cleanup, err := pgfencetest.Open(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()
	client, err := lock.New(db.Pool, lock.Config{Schema: db.Schema, Holder: "node-a"})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(ctx)
	if _, err := client.Acquire(ctx, "nightly-billing"); err != nil {
		log.Fatal(err)
	}

	mux := http.NewServeMux()
	page, err := web.New(db.Pool, web.Config{
		Schema: db.Schema,
		// The names it is served under, besides localhost and IP addresses.
		Hosts: []string{"ops.example.com"},
		// true offers force release, run now, pause and resume; false: no buttons, POST answered 403.
		AllowActions: false,
		// Who asked, in the log line of each action and in the ledger.
		Identity: func(r *http.Request) string { return r.Header.Get("X-Authenticated-User") },
	})
	if err != nil {
		log.Fatal(err)
	}
	mux.Handle("/pgfence/", http.StripPrefix("/pgfence", page))
	// In a program: http.ListenAndServe("127.0.0.1:8080", mux), behind the
	// application's authentication.
	srv := httptest.NewServer(mux)
	defer srv.Close()

	res, err := http.Get(srv.URL + "/pgfence/")
	if err != nil {
		log.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	fmt.Println(res.StatusCode, strings.Contains(string(body), "nightly-billing"))
	res, err = http.Post(srv.URL+"/pgfence/pause", "application/x-www-form-urlencoded", strings.NewReader("job=nightly"))
	if err != nil {
		log.Fatal(err)
	}
	res.Body.Close()
	fmt.Println("pause without AllowActions:", res.StatusCode)
	// Output:
	// 200 true
	// pause without AllowActions: 403
}
