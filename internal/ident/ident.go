// Package ident validates and quotes the SQL identifiers pgfence builds from
// configuration (schema names). Values never travel this way: they are always
// query parameters.
package ident

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

// ErrInvalid reports a schema name that cannot be used as a PostgreSQL identifier.
var ErrInvalid = errors.New("invalid SQL identifier")

// maxLen is PostgreSQL's NAMEDATALEN-1: longer names are silently truncated by
// the server, which would make two configured schemas collide.
const maxLen = 63

// DefaultSchema is the schema every pgfence entry point uses when none is
// named (lock.Config, runner.Config, fence.Guard, fence.Resource, the
// migrations and the CLI): one default, so that a program and the operator
// CLI find the same tables without being told.
const DefaultSchema = "pgfence"

// Schema returns schema, or DefaultSchema when it is empty.
func Schema(schema string) string {
	if schema == "" {
		return DefaultSchema
	}
	return schema
}

// ValidateSchema checks a schema name from configuration. The empty string is
// valid and means DefaultSchema.
func ValidateSchema(schema string) error {
	if schema == "" {
		return nil
	}
	switch {
	case !utf8.ValidString(schema):
		return fmt.Errorf("%w: schema name is not valid UTF-8", ErrInvalid)
	case len(schema) > maxLen:
		return fmt.Errorf("%w: schema name is %d bytes, the limit is %d", ErrInvalid, len(schema), maxLen)
	case strings.ContainsRune(schema, 0):
		return fmt.Errorf("%w: schema name contains a NUL byte", ErrInvalid)
	case strings.ContainsRune(schema, '$'):
		// The migrations build functions whose bodies name the schema
		// inside dollar quotes; a '$' could end them early.
		return fmt.Errorf("%w: schema name contains '$'", ErrInvalid)
	}
	return nil
}

// Table returns the quoted, schema-qualified name of a pgfence object
// (schema "" is DefaultSchema). schema must have passed ValidateSchema.
func Table(schema, name string) string {
	return pgx.Identifier{Schema(schema), name}.Sanitize()
}

// ShellQuote quotes s for a POSIX shell, for the commands pgfence's messages
// suggest; names made of letters, digits and _-. stay as they are.
func ShellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r == '_' || r == '-' || r == '.' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9')
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
