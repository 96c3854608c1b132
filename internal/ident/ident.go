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

// ValidateSchema checks a schema name from configuration. The empty string is
// valid and means "the connection's search_path".
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

// Table returns the quoted, optionally schema-qualified name of a pgfence
// object. schema must have passed ValidateSchema.
func Table(schema, name string) string {
	if schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{schema, name}.Sanitize()
}
