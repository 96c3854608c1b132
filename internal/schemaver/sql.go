package schemaver

import "github.com/pgfence/pgfence/internal/ident"

// stateSQL reads whether schema $1 exists, whether the role may use it,
// the role's name and, only when it may (to_regclass needs USAGE: without
// it the version table would look missing, and the schema "not migrated"),
// the version table $2's name.
const stateSQL = `SELECT n.oid IS NOT NULL, coalesce(has_schema_privilege(n.oid, 'USAGE'), false), current_user,
       CASE WHEN has_schema_privilege(n.oid, 'USAGE') THEN to_regclass(format('%I.%I', $1::text, $2::text))::text END
  FROM (SELECT) AS one LEFT JOIN pg_namespace n ON n.nspname = $1`

// versionsSQL reads when each applied version of schema was applied.
func versionsSQL(schema string) string {
	return `SELECT version_id, max(tstamp) FROM ` + ident.Table(schema, VersionTable) +
		` WHERE is_applied AND version_id > 0 GROUP BY version_id`
}

// epochSQL reads schema's token epoch.
func epochSQL(schema string) string {
	return `SELECT timeline, started_at, first_token FROM ` + ident.Table(schema, "pgfence_epoch")
}
