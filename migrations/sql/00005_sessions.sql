-- Sessions: a client keeps one row alive, and every lease it holds lives
-- and dies with it. A renewal is one UPDATE of that row, whatever the number
-- of leases (before this, every lease row was renewed: 100,000 leases cost a
-- third of a 2-core server just to hold).
--   * A lease is held while its row names a session (session) that has not
--     expired by the database clock. Released, force-released and revoked
--     leases name none. Session rows are never deleted (one per client that
--     acquired, ended by its Close or its expiry): an acquisition frees a
--     lease only on seeing its session expired, so a lease naming a deleted
--     session would stay held until force-released.
--   * A takeover of a lease whose session expired locks that session's row
--     and counts the loss there (losses), in the acquisition's transaction:
--     a renewal in flight and the takeover serialise on the row (the one
--     that comes second sees what the first did), and a renewal that
--     returns an unchanged count proves that none of the session's leases
--     was taken since the last one. Locks are taken lease row first, then
--     session row, so they cannot deadlock.
--   * ForceRelease and revocations take a lease from a live session, which
--     needs no such proof (the token, or its absence, refuses the holder's
--     writes; the holder learns it at its next renewal). They record the
--     loss as a row of pgfence_session_losses, without locking the
--     session's row: a revocation may sit in a longer transaction of the
--     caller's (runner.Seek), and the session's renewals, which count these
--     rows too, must not wait for it.
--   * The lease row keeps token, holder (for operators), the acquisition's
--     secret, and freed_at: when it was last freed (a release, a
--     force-release, a revocation), shown while nobody holds it.
--   * pgfence_lease_states joins both tables into what the leases table
--     showed before: expires_at is the session's expiry while a session is
--     named, else freed_at.
--
-- Upgrading a live database: every lease held when the migration runs keeps
-- its expiry, under a session of its own that nobody renews, so nobody can
-- take it before its holder stops trusting it. A client of an earlier
-- version fails its next renewal (the columns it updates are gone) and ends
-- its leases at their trust deadlines, before they expire here: stop such
-- clients, or let them lose their leases this way, then start the new
-- version. Tokens are untouched. Grant the roles again after the upgrade
-- (pgfence grant app ROLE, pgfence grant operator ROLE): the new tables and
-- columns need their rights.

-- +goose Up
CREATE TABLE pgfence_sessions (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    holder     text        NOT NULL,
    started_at timestamptz NOT NULL,
    renewed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    losses     bigint      NOT NULL DEFAULT 0
) WITH (fillfactor = 50);

CREATE INDEX pgfence_sessions_expires ON pgfence_sessions (expires_at);

CREATE TABLE pgfence_session_losses (
    session bigint      NOT NULL,
    name    text        NOT NULL,
    lost_at timestamptz NOT NULL
);

CREATE INDEX pgfence_session_losses_session ON pgfence_session_losses (session);

ALTER TABLE pgfence_leases ADD COLUMN session bigint, ADD COLUMN freed_at timestamptz;

-- Leases held now: a session each, expiring with the lease.
-- +goose StatementBegin
DO $do$
DECLARE
    r   record;
    sid bigint;
BEGIN
    FOR r IN SELECT name, holder, acquired_at, renewed_at, expires_at FROM pgfence_leases
              WHERE holder IS NOT NULL AND expires_at > now() ORDER BY name FOR UPDATE LOOP
        INSERT INTO pgfence_sessions (holder, started_at, renewed_at, expires_at)
        VALUES (r.holder, r.acquired_at, r.renewed_at, r.expires_at) RETURNING id INTO sid;
        UPDATE pgfence_leases SET session = sid WHERE name = r.name;
    END LOOP;
END
$do$;
-- +goose StatementEnd

UPDATE pgfence_leases SET freed_at = expires_at WHERE session IS NULL;

ALTER TABLE pgfence_leases DROP COLUMN renewed_at, DROP COLUMN expires_at;

CREATE VIEW pgfence_lease_states AS
SELECT l.name, l.token, l.holder, l.session, l.acquired_at,
       coalesce(s.renewed_at, l.acquired_at) AS renewed_at,
       CASE WHEN l.session IS NULL THEN l.freed_at ELSE s.expires_at END AS expires_at
  FROM pgfence_leases l LEFT JOIN pgfence_sessions s ON s.id = l.session;

-- +goose Down
-- Renewals of the new layout write only pgfence_sessions: locked first, so
-- that none commits after its expiry has been copied to the lease rows.
LOCK TABLE pgfence_leases, pgfence_sessions IN ACCESS EXCLUSIVE MODE;
ALTER TABLE pgfence_leases ADD COLUMN renewed_at timestamptz, ADD COLUMN expires_at timestamptz;
UPDATE pgfence_leases l
   SET renewed_at = coalesce(s.renewed_at, l.acquired_at),
       expires_at = coalesce(CASE WHEN l.session IS NULL THEN l.freed_at ELSE s.expires_at END, l.acquired_at)
  FROM pgfence_leases l2 LEFT JOIN pgfence_sessions s ON s.id = l2.session
 WHERE l2.name = l.name;
ALTER TABLE pgfence_leases ALTER COLUMN renewed_at SET NOT NULL, ALTER COLUMN expires_at SET NOT NULL;
DROP VIEW pgfence_lease_states;
ALTER TABLE pgfence_leases DROP COLUMN session, DROP COLUMN freed_at;
DROP TABLE pgfence_session_losses;
DROP TABLE pgfence_sessions;
