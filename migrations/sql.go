package migrations

import (
	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/ident"
)

// The package's own statements (the schema itself is in sql/*.sql).
const (
	sqlServerVersion = `SELECT current_setting('server_version_num')::int`
	sqlSchemaExists  = `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`
	// The migration lock: a transaction-level one while a schema is
	// created, a session-level one while goose migrates (the two conflict).
	sqlXactLock      = `SELECT pg_advisory_xact_lock($1)`
	sqlSessionLock   = `SELECT pg_advisory_lock($1)`
	sqlSessionUnlock = `SELECT pg_advisory_unlock($1)`
)

// createSchemaSQL creates schema (validated) if it does not exist.
func createSchemaSQL(schema string) string {
	return "CREATE SCHEMA IF NOT EXISTS " + pgx.Identifier{schema}.Sanitize()
}

// syncEpochSQL moves the token sequence into the current history after a
// restore into another cluster (pgfence_sync_epoch); not on a standby.
func syncEpochSQL(schema string) string {
	return `SELECT NOT pg_is_in_recovery() AND ` + ident.Table(schema, "pgfence_sync_epoch") + `()`
}

// leaseUpdateSQL grants UPDATE on every column of pgfence_leases but its key:
// renaming a row would end its holder's lease (the renewals miss it). A
// table-wide UPDATE, as earlier grants gave, is revoked first, with the
// column grants it carries, so that granting again tightens it.
func leaseUpdateSQL(schema, r string) []string {
	t := ident.Table(schema, "pgfence_leases")
	return []string{
		"REVOKE UPDATE ON " + t + " FROM " + r,
		"GRANT UPDATE (token, holder, secret, session, acquired_at, freed_at, waiters_until, observers_until) ON " +
			t + " TO " + r,
	}
}

// appGrantSQL is AppGrants' statements for schema, whose quoted name is s, and
// the quoted role r.
func appGrantSQL(schema, s, r string) []string {
	t := func(name string) string { return ident.Table(schema, name) }
	return append([]string{
		"GRANT USAGE ON SCHEMA " + s + " TO " + r,
		"GRANT SELECT, INSERT ON " + t("pgfence_leases") + ", " + t("pgfence_fences") + " TO " + r,
		// A client's session: started, renewed, ended (never deleted).
		"GRANT SELECT, INSERT, UPDATE ON " + t("pgfence_sessions") + " TO " + r,
		"GRANT SELECT, INSERT ON " + t("pgfence_session_losses") + " TO " + r,
		"GRANT SELECT ON " + t("pgfence_lease_states") + " TO " + r,
		// Not the key of a fence either: a renamed fence would let its
		// resource's mark start again (the trigger refuses it to the owner).
		"REVOKE UPDATE ON " + t("pgfence_fences") + " FROM " + r,
		"GRANT UPDATE (token, updated_at) ON " + t("pgfence_fences") + " TO " + r,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON " + t("pgfence_runs") + ", " + t("pgfence_instances") + " TO " + r,
		"GRANT SELECT, INSERT, UPDATE ON " + t("pgfence_jobs") + ", " + t("pgfence_groups") + " TO " + r,
		// Not the key of an offset: the trigger refuses that anyway. An
		// offset row is created with its key only: a row inserted with a
		// token of the application's choosing would refuse every leader.
		"REVOKE INSERT, UPDATE ON " + t("pgfence_offsets") + " FROM " + r,
		"GRANT SELECT, INSERT (group_name, partition) ON " + t("pgfence_offsets") + " TO " + r,
		"GRANT UPDATE (committed_offset, token, holder, advanced_at, committed_at, commits, end_offset, end_at, until_offset) ON " + t("pgfence_offsets") + " TO " + r,
		// The terms are a record for operators; no fence reads them.
		"GRANT SELECT, INSERT, UPDATE, DELETE ON " + t("pgfence_terms") + " TO " + r,
		"GRANT SELECT ON " + t(VersionTable) + ", " + t("pgfence_epoch") + " TO " + r,
		"GRANT EXECUTE ON FUNCTION " + t("pgfence_check") + "(text, bigint), " + t("pgfence_admit") + "(text, bigint), " +
			t("pgfence_wake_waiters") + "(text), " + t("pgfence_sync_epoch") + "(), " +
			t("pgfence_timeline") + "(), " + t("pgfence_epoch_timeline") + "() TO " + r,
	}, leaseUpdateSQL(schema, r)...)
}

// operatorGrantSQL is OperatorGrants' statements, as appGrantSQL.
func operatorGrantSQL(schema, s, r string) []string {
	t := func(name string) string { return ident.Table(schema, name) }
	return append([]string{
		"GRANT USAGE ON SCHEMA " + s + " TO " + r,
		"GRANT SELECT ON " + t("pgfence_leases") + ", " + t("pgfence_fences") + ", " + t("pgfence_runs") + ", " +
			t("pgfence_jobs") + ", " + t("pgfence_instances") + ", " + t("pgfence_offsets") + ", " + t("pgfence_epoch") + ", " +
			t("pgfence_groups") + ", " + t("pgfence_terms") + ", " + t(VersionTable) + ", " + t("pgfence_sessions") + ", " +
			t("pgfence_lease_states") + " TO " + r,
		"GRANT UPDATE ON " + t("pgfence_jobs") + ", " + t("pgfence_groups") + " TO " + r,
		// ForceRelease and revocations record the loss for the holder's
		// session, whose client learns it at its next renewal.
		"GRANT INSERT ON " + t("pgfence_session_losses") + " TO " + r,
		"GRANT INSERT, DELETE ON " + t("pgfence_runs") + " TO " + r,
		// Prune deletes the terms that ended with the runs; Seek closes
		// the term it revokes, and sets the offset with the revoking token
		// (lock.RevokeTx issues it: the epoch check's functions).
		"GRANT UPDATE, DELETE ON " + t("pgfence_terms") + " TO " + r,
		// SetPartitions with replicas running sets the cut on the offsets
		// (created with their key for partitions never led).
		"GRANT INSERT (group_name, partition) ON " + t("pgfence_offsets") + " TO " + r,
		"GRANT UPDATE (committed_offset, token, holder, advanced_at, committed_at, commits, until_offset) ON " + t("pgfence_offsets") + " TO " + r,
		// pgfence_timeline: RunNow reads its transaction's id and timeline,
		// to learn whether it committed if COMMIT's answer is lost.
		"GRANT EXECUTE ON FUNCTION " + t("pgfence_wake_waiters") + "(text), " + t("pgfence_timeline") + "(), " +
			t("pgfence_sync_epoch") + "(), " + t("pgfence_epoch_timeline") + "() TO " + r,
	}, leaseUpdateSQL(schema, r)...)
}
