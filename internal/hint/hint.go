// Package hint adds what to do to the database errors pgfence passes on when
// the cause is the deployment, not the call: a role without pgfence's grants
// (42501), or pgfence's objects missing from the schema looked in (42P01,
// 42883, 3F000). The database error stays inspectable with errors.As.
package hint

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/ident"
)

// Error is a database error with what to do about it.
type Error struct {
	Err  error
	Hint string
}

// Error returns the error's text and the hint.
func (e *Error) Error() string { return e.Err.Error() + " (" + e.Hint + ")" }

// Unwrap returns the database error.
func (e *Error) Unwrap() error { return e.Err }

// Codes pgfence explains.
const (
	CodeNoPrivilege = "42501" // insufficient_privilege
	CodeNoTable     = "42P01" // undefined_table
	CodeNoFunction  = "42883" // undefined_function
	CodeNoSchema    = "3F000" // invalid_schema_name
)

// Wrap explains err when it is one of the codes above, for a role working
// in schema ("" is the default schema). role may be "" when unknown.
// Errors already explained, and all others, are returned as they are.
func Wrap(err error, schema, role string) error {
	var pg *pgconn.PgError
	var done *Error
	if err == nil || errors.As(err, &done) || !errors.As(err, &pg) {
		return err
	}
	schema = ident.Schema(schema)
	switch pg.Code {
	case CodeNoPrivilege:
		return &Error{err, Grant(schema, role)}
	case CodeNoTable, CodeNoFunction, CodeNoSchema:
		return &Error{err, fmt.Sprintf("pgfence looked in schema %s: run migrations.Up or `pgfence%s migrate up` there, "+
			"or name the schema that holds pgfence's tables (Schema in Go; --schema or PGFENCE_SCHEMA in the CLI)", strconv.Quote(schema), flag(schema))}
	}
	return err
}

// Grant says which grant a role lacks in schema and how to give it.
func Grant(schema, role string) string {
	who := "this role"
	arg := "ROLE"
	if role != "" {
		who, arg = "role "+strconv.Quote(role), ident.ShellQuote(role)
	}
	return fmt.Sprintf("%s lacks pgfence's grants on schema %s: as the schema's owner, run `pgfence%s grant app %s` "+
		"(or `grant operator` for the operator CLI), or migrations.GrantApp", who, strconv.Quote(ident.Schema(schema)),
		flag(ident.Schema(schema)), arg)
}

func flag(schema string) string {
	if schema == ident.DefaultSchema {
		return ""
	}
	return " --schema " + ident.ShellQuote(schema)
}

// Role returns the role that db (a pool, a connection or a transaction)
// connects as, or "" when it cannot tell.
func Role(db any) string {
	switch d := db.(type) {
	case interface{ Config() *pgxpool.Config }:
		return d.Config().ConnConfig.User
	case interface{ Config() *pgx.ConnConfig }:
		return d.Config().User
	case interface{ Conn() *pgx.Conn }:
		if c := d.Conn(); c != nil {
			return c.Config().User
		}
	}
	return ""
}
