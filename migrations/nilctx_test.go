package migrations_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/fence"
	"github.com/pgfence/pgfence/internal/pgtest"
	"github.com/pgfence/pgfence/migrations"
)

// Every function that takes a context refuses a nil one with
// fence.ErrNilContext, naming the call, before it touches the database.
// Formerly each panicked inside pgx.
func TestNilContext(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	var nilCtx context.Context
	calls := []struct {
		op   string
		call func() error
	}{
		{"Up", func() error { _, err := migrations.Up(nilCtx, db.Pool, db.Schema); return err }},
		{"Status", func() error { _, err := migrations.Status(nilCtx, db.Pool, db.Schema); return err }},
		{"Verify", func() error { return migrations.Verify(nilCtx, db.Pool, db.Schema) }},
		{"GrantApp", func() error { return migrations.GrantApp(nilCtx, db.Pool, db.Schema, "nobody") }},
		{"GrantOperator", func() error { return migrations.GrantOperator(nilCtx, db.Pool, db.Schema, "nobody") }},
	}
	for _, tc := range calls {
		err := pgtest.NoPanic(tc.call)
		if !errors.Is(err, fence.ErrNilContext) || !strings.HasPrefix(err.Error(), "migrations: "+tc.op+": ") {
			t.Errorf("%s with a nil context: %v; want \"migrations: %s: \" and fence.ErrNilContext", tc.op, err, tc.op)
		}
	}
}
