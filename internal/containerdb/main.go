// Command containerdb starts a throwaway PostgreSQL in a container for
// pgfence's own tests, on machines with Docker and no TEST_DATABASE_URL. It
// prints "URL <connection string>" on a line of its own, keeps the container
// until its standard input closes, then removes it.
//
// It is a module of its own so that testcontainers (and the Docker client it
// brings) is compiled only when a container is needed: internal/pgtest runs it
// with `go run`, and neither pgfence's go.mod nor any test binary depends on it.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
)

// image is the PostgreSQL image started.
const image = "postgres:16-alpine"

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	c, err := tcpostgres.Run(ctx, image,
		tcpostgres.WithDatabase("pgfence"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		cancel()
		if c != nil {
			_ = testcontainers.TerminateContainer(c)
		}
		fmt.Fprintln(os.Stderr, "containerdb: start PostgreSQL container:", err)
		os.Exit(1)
	}
	url, err := c.ConnectionString(ctx, "sslmode=disable")
	cancel()
	if err != nil {
		_ = testcontainers.TerminateContainer(c)
		fmt.Fprintln(os.Stderr, "containerdb:", err)
		os.Exit(1)
	}
	fmt.Println("URL", url)
	_, _ = io.Copy(io.Discard, os.Stdin) // until the tests are done
	_ = testcontainers.TerminateContainer(c)
}
