// Package devdb starts a throwaway PostgreSQL container for pgfence's own
// tests where Docker is available (internal/pgtest uses it when
// TEST_DATABASE_URL is not set). It is internal: importers of pgfence never
// build it, so testcontainers stays out of their binaries.
package devdb

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
)

// ErrNoDocker is returned by Container when no Docker engine is reachable.
var ErrNoDocker = errors.New("no Docker engine found (no DOCKER_HOST and no /var/run/docker.sock)")

// Image is the PostgreSQL image started when a container is needed.
const Image = "postgres:16-alpine"

// DockerAvailable reports whether a Docker engine looks reachable. It only
// looks for the usual endpoints; starting a container can still fail.
// PGFENCE_NO_DOCKER=1 makes it false.
func DockerAvailable() bool {
	if os.Getenv("PGFENCE_NO_DOCKER") == "1" {
		return false
	}
	if os.Getenv("DOCKER_HOST") != "" {
		return true
	}
	for _, p := range []string{"/var/run/docker.sock", os.ExpandEnv("$HOME/.docker/run/docker.sock")} {
		if fi, err := os.Stat(p); err == nil && fi.Mode()&os.ModeSocket != 0 {
			return true
		}
	}
	return false
}

// Container starts a throwaway PostgreSQL container and returns its URL and a
// function that removes it.
func Container(ctx context.Context) (url string, stop func(), err error) {
	if !DockerAvailable() {
		return "", nil, ErrNoDocker
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	c, err := tcpostgres.Run(ctx, Image,
		tcpostgres.WithDatabase("pgfence"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		if c != nil {
			_ = testcontainers.TerminateContainer(c)
		}
		return "", nil, fmt.Errorf("start PostgreSQL container: %w", err)
	}
	url, err = c.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = testcontainers.TerminateContainer(c)
		return "", nil, err
	}
	return url, func() { _ = testcontainers.TerminateContainer(c) }, nil
}
