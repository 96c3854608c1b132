// Package devdb finds a PostgreSQL server for tests and examples: an explicit
// URL from the environment, a throwaway container where Docker is available,
// or (for examples) the libpq defaults. It is internal: importers of pgfence
// never build it, so testcontainers stays out of their binaries.
package devdb

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/pgfence/pgfence/migrations"
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

// ErrNoDatabase is returned by Connect when no server could be found.
var ErrNoDatabase = errors.New(`no PostgreSQL server found. Provide one with
  DATABASE_URL='postgres://user:pass@host:5432/db?sslmode=disable'
or the libpq variables (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD),
or make a Docker engine available so a throwaway server can be started`)

// Connect finds a database the way the examples document: DATABASE_URL if
// set; otherwise a throwaway container where Docker is available; otherwise
// the libpq defaults (PGHOST, PGPORT, ... then a local socket or
// localhost:5432). It returns the pool, where it connected, and a cleanup.
func Connect(ctx context.Context) (*pgxpool.Pool, string, func(), error) {
	try := func(url, where string, stop func()) (*pgxpool.Pool, string, func(), error) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		pool, err := pgxpool.New(cctx, url)
		if err == nil {
			err = pool.Ping(cctx)
		}
		if err != nil {
			if pool != nil {
				pool.Close()
			}
			if stop != nil {
				stop()
			}
			return nil, "", nil, err
		}
		cleanup := pool.Close
		if stop != nil {
			cleanup = func() { pool.Close(); stop() }
		}
		return pool, where, cleanup, nil
	}
	if u := os.Getenv("DATABASE_URL"); u != "" {
		pool, where, cleanup, err := try(u, "DATABASE_URL", nil)
		if err != nil {
			return nil, "", nil, fmt.Errorf("DATABASE_URL is set but does not answer: %w", err)
		}
		return pool, where, cleanup, nil
	}
	if DockerAvailable() {
		if u, stop, err := Container(ctx); err == nil {
			if pool, where, cleanup, err := try(u, "a throwaway container ("+Image+")", stop); err == nil {
				return pool, where, cleanup, nil
			}
		}
	}
	pool, _, cleanup, err := try("", "", nil)
	if err != nil {
		return nil, "", nil, fmt.Errorf("%w\n(libpq defaults: %v)", ErrNoDatabase, err)
	}
	cfg := pool.Config().ConnConfig
	return pool, fmt.Sprintf("libpq defaults (%s:%d)", cfg.Host, cfg.Port), cleanup, nil
}

// FreshSchema drops schema (with everything in it) and applies pgfence's
// migrations there, so an example starts from a clean slate on every run.
func FreshSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		return err
	}
	_, err := migrations.Up(ctx, pool, schema)
	return err
}
