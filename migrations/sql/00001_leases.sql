-- Leases: one row per lease name; token is both the lock's version and the
-- fencing token. Why it looks like this (measurements: BENCHMARKS.md):
--   * token is an identity column: an acquisition sets token = DEFAULT (a
--     fresh nextval) and nothing else can set it, so tokens only rise, for
--     every lease of the table alike, and a decrease is refused by the schema
--     (SQLSTATE 428C9). CACHE 1, or values would come out of order across
--     sessions.
--   * No index on token and no row trigger on UPDATE, so acquisitions are
--     HOT updates; fillfactor 10 leaves them room on the page. The fence
--     still makes a takeover wait for open guarded transactions
--     (pgfence_check holds FOR KEY SHARE): the library's acquisition locks the
--     row FOR UPDATE first. A token raised by hand must do the same.
--   * Rows are never deleted (tokens would restart) and the table is logged
--     (an UNLOGGED table is emptied by a crash). CHECKs are done by an insert
--     trigger: PostgreSQL re-prepares a table's CHECKs on every UPDATE.
--   * waiters_until: set by blocked acquirers, so that a release sends NOTIFY
--     only when someone waits (pgfence_wake_waiters); observers_until: set
--     by observers (lock.Client.Observe), so that an acquisition sends one
--     only when someone observes.
--   * Tokens survive a failover: token = ms << 22 | n, where a new history
--     (a promotion, a restore) starts at the promoted server's clock
--     (pgfence_epoch, below), so every token issued after a promotion is
--     above every token the old primary could have issued, replicated or
--     not.

-- +goose Up
CREATE TABLE pgfence_leases (
    name          text        PRIMARY KEY,
    token         bigint      GENERATED ALWAYS AS IDENTITY (CACHE 1),
    holder        text,
    secret        bytea,
    acquired_at   timestamptz NOT NULL,
    renewed_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    waiters_until timestamptz,
    observers_until timestamptz
) WITH (fillfactor = 10);

-- +goose StatementBegin
CREATE FUNCTION pgfence_leases_protect() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: lease rows are never deleted (tokens must not restart)'
        USING ERRCODE = 'PF010';
END
$$;
-- +goose StatementEnd

CREATE TRIGGER pgfence_leases_protect_delete BEFORE DELETE ON pgfence_leases
    FOR EACH ROW EXECUTE FUNCTION pgfence_leases_protect();
CREATE TRIGGER pgfence_leases_protect_truncate BEFORE TRUNCATE ON pgfence_leases
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence_leases_protect();

-- A name's first acquisition inserts its row, with token = DEFAULT (a fresh
-- nextval). An INSERT can override the token (OVERRIDING SYSTEM VALUE):
-- refuse any token other than the one the sequence just issued to this row,
-- so no INSERT can reuse a token already issued (later acquisitions would go
-- below it, or two holders would share it). "Just issued" is currval, but
-- currval stays set for the whole session: a pooled session that once
-- acquired would pass it with its last token. So a statement trigger notes
-- currval before the INSERT's rows are formed (pgfence.insert_mark, local to
-- the transaction), and a row's token must differ from the noted one: drawn
-- during this statement, for this row (each accepted row moves the mark).
-- SECURITY DEFINER: currval needs a privilege on the sequence that the
-- application role need not have; both run only on a name's first
-- acquisition, off the hot path.
-- +goose StatementBegin
CREATE FUNCTION pgfence_leases_mark_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    last bigint;
BEGIN
    BEGIN
        last := currval(pg_get_serial_sequence(format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME), 'token'));
    EXCEPTION WHEN object_not_in_prerequisite_state THEN
        last := NULL; -- the sequence issued nothing in this session
    END;
    PERFORM set_config('pgfence.insert_mark', TG_RELID::text || ':' || coalesce(last::text, ''), true);
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION pgfence_leases_check_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    fresh bigint;
    mark  text := current_setting('pgfence.insert_mark', true);
BEGIN
    BEGIN
        fresh := currval(pg_get_serial_sequence(format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME), 'token'));
    EXCEPTION WHEN object_not_in_prerequisite_state THEN
        fresh := NULL; -- the sequence issued nothing in this session
    END;
    IF NEW.token IS DISTINCT FROM fresh OR mark IS NULL OR split_part(mark, ':', 1) <> TG_RELID::text
       OR split_part(mark, ':', 2) = NEW.token::text THEN
        RAISE EXCEPTION 'pgfence: token % of lease % was not just issued by the token sequence', NEW.token, NEW.name
            USING ERRCODE = 'PF010';
    END IF;
    PERFORM set_config('pgfence.insert_mark', TG_RELID::text || ':' || NEW.token::text, true);
    IF octet_length(NEW.name) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION 'pgfence: a lease name must be 1 to 255 bytes long'
            USING ERRCODE = '23514';
    END IF;
    IF (NEW.holder IS NULL) <> (NEW.secret IS NULL) THEN
        RAISE EXCEPTION 'pgfence: a held lease has a secret and a free one has none'
            USING ERRCODE = '23514';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER pgfence_leases_mark_insert BEFORE INSERT ON pgfence_leases
    FOR EACH STATEMENT EXECUTE FUNCTION pgfence_leases_mark_insert();
CREATE TRIGGER pgfence_leases_check_insert BEFORE INSERT ON pgfence_leases
    FOR EACH ROW EXECUTE FUNCTION pgfence_leases_check_insert();

-- The token epoch. A promotion (or a point-in-time recovery, or a logical
-- restore into another cluster) starts a new history, and after
-- asynchronous replication the new history may lack tokens the old primary
-- issued. Timeline IDs cannot order histories: without a WAL archive shared
-- by every node, a standby that never saw a promotion, promoted later, picks
-- the same timeline ID as the one it missed. What orders them is time: a
-- token is a millisecond count since 2026-01-01 UTC in its high bits and a
-- count of acquisitions in its low 22,
--     token = ms << 22 | n,
-- and on the first acquisition of a new history the token sequence jumps to
-- the promoted server's clock: (ms now) << 22. Within a history the sequence
-- counts on by one, so its tokens stay below (the issuing server's clock) <<
-- 22 unless it issues more than 4,194,304 tokens a millisecond. Hence every
-- token a promoted server issues is above every token the old primary
-- issued, replicated or not, provided the promoted server's clock is ahead of
-- the old primary's clock at the old primary's last acquisition: the servers'
-- clocks may differ by less than the time between the old primary's last
-- acquisition and the promotion (with Patroni, at least ttl - loop_wait). A
-- server whose clock is behind the tokens it knows of refuses to start the
-- history (PF013) until its clock has caught up. A database that never
-- failed over issues 1, 2, 3...; 41 bits of milliseconds last until 2095.
-- One row, the current history:
--   timeline           the timeline it started on (acquisitions compare the
--                      server's timeline with it: a new one starts a history);
--   system_identifier  the cluster (pg_control_system) it started on: a
--                      logical dump restored elsewhere, or pg_upgrade, starts
--                      a new history too, detected once per client;
--   started_at         the server's clock when it started;
--   first_token        the first token it issued (every later one is above).
CREATE TABLE pgfence_epoch (
    one               boolean     PRIMARY KEY DEFAULT true CHECK (one),
    timeline          bigint      NOT NULL,
    system_identifier bigint      NOT NULL,
    started_at        timestamptz NOT NULL,
    first_token       bigint      NOT NULL
);

-- The server's current timeline, from memory: the name of the WAL segment
-- being written starts with it (8 hex digits; PostgreSQL names it after the
-- insertion timeline, so it is the new one at once after a promotion, while
-- pg_control_checkpoint() shows the old one until the next checkpoint). On
-- a standby it raises 55000: acquisitions need a primary.
-- +goose StatementBegin
CREATE FUNCTION pgfence_timeline() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || left(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 8))::bit(32)::bigint
$$;
-- +goose StatementEnd

INSERT INTO pgfence_epoch (timeline, system_identifier, started_at, first_token)
SELECT pgfence_timeline(), s.system_identifier, clock_timestamp(), 1 FROM pg_control_system() s;

-- pgfence_epoch_timeline() is the timeline the current history started on:
-- a constant that pgfence_sync_epoch rewrites when a history starts (0, no
-- timeline, until the first sync: Up runs one). The acquisitions' check
-- compares it with pgfence_timeline(); both are plain SQL functions that
-- PostgreSQL inlines, so the check reads no table (a read of the epoch row
-- cost about 9% of the acquisition statement). Replacing the function
-- invalidates the plans that inlined it.
CREATE FUNCTION pgfence_epoch_timeline() RETURNS bigint
LANGUAGE sql IMMUTABLE AS 'SELECT 0::bigint';

-- pgfence_sync_epoch() starts a new history if the server is on another
-- timeline or cluster than the current history's, and returns true.
-- Acquisitions call it when their check fails, which is once per new
-- timeline (the check, in each acquisition statement before the sequence
-- issues the token:
--   pgfence_timeline() = pgfence_epoch_timeline() OR pgfence_sync_epoch());
-- clients call it once when they start (the cluster check is a file read,
-- too slow for every acquisition), and so does migrations.Up. Starts are
-- serialised by the row lock; the sequence is raised (setval, which is not
-- transactional) before the row says so, and never lowered, so an
-- acquisition that sees the new history committed draws from its range.
-- clock_timestamp(), not now(): the later reading is the safe one.
-- SECURITY DEFINER: setval needs a privilege the application need not have.
-- +goose StatementBegin
DO $do$
BEGIN
EXECUTE format($fn$
CREATE FUNCTION %1$I.pgfence_sync_epoch() RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
    e      record;
    tl     bigint := %1$I.pgfence_timeline();
    sysid  bigint;
    clock  timestamptz;
    ms     bigint;
    last   bigint;
    seq    regclass := pg_get_serial_sequence(%2$L, 'token')::regclass;
BEGIN
    SELECT s.system_identifier INTO sysid FROM pg_control_system() s;
    SELECT * INTO e FROM %1$I.pgfence_epoch;
    IF e.system_identifier = sysid AND e.timeline = tl AND %1$I.pgfence_epoch_timeline() = tl THEN
        RETURN true;
    END IF;
    SELECT * INTO e FROM %1$I.pgfence_epoch FOR UPDATE;
    IF e.system_identifier <> sysid OR e.timeline <> tl THEN
        clock := clock_timestamp();
        ms := floor(extract(epoch FROM clock - timestamptz '2026-01-01 00:00:00+00') * 1000)::bigint;
        last := coalesce(pg_sequence_last_value(seq), 0);
        IF ms >= 1::bigint << 41 THEN
            RAISE EXCEPTION 'pgfence: the server''s clock (%%) is beyond the last token epoch (2095)', clock
                USING ERRCODE = 'PF012';
        END IF;
        IF ms < 0 OR ms << 22 <= last THEN
            RAISE EXCEPTION 'pgfence: the server''s clock (%%) is behind the newest token issued (%%, from %%): tokens of a lost history could repeat', clock, last,
                    timestamptz '2026-01-01 00:00:00+00' + ((last >> 22) * interval '1 millisecond')
                USING ERRCODE = 'PF013',
                      HINT = 'Synchronise the servers'' clocks (NTP); acquisitions go on once this server''s clock has passed the newest token''s.';
        END IF;
        PERFORM setval(seq, ms << 22, false);
        UPDATE %1$I.pgfence_epoch SET timeline = tl, system_identifier = sysid, started_at = clock, first_token = ms << 22;
    END IF;
    IF %1$I.pgfence_epoch_timeline() IS DISTINCT FROM tl THEN
        EXECUTE format('CREATE OR REPLACE FUNCTION %%I.pgfence_epoch_timeline() RETURNS bigint LANGUAGE sql IMMUTABLE AS %%L',
            %3$L, 'SELECT ' || tl || '::bigint');
    END IF;
    RETURN true;
END
$body$
$fn$, current_schema(), format('%I.%I', current_schema(), 'pgfence_leases'), current_schema());
END
$do$;
-- +goose StatementEnd

-- pgfence_check(name, token) is the fence, called inside the protected
-- transaction: it locks the lease row FOR KEY SHARE until the transaction
-- ends (a takeover waits for it) and raises unless token is the newest one
-- issued: PF001 stale (DETAIL: the current token), PF002 no such lease,
-- PF003 never issued. Raising lets the check be pipelined with the caller's
-- statements: the server skips the rest, and the transaction cannot commit.
-- The schema is baked into the body (a SET search_path clause costs a
-- configuration save and restore per call).
-- +goose StatementBegin
DO $do$
BEGIN
EXECUTE format($fn$
CREATE FUNCTION %1$I.pgfence_check(p_name text, p_token bigint) RETURNS bigint
LANGUAGE plpgsql
AS $body$
DECLARE
    cur bigint;
BEGIN
    SELECT l.token INTO cur FROM %1$I.pgfence_leases l WHERE l.name = p_name FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgfence: no lease named %%', p_name
            USING ERRCODE = 'PF002';
    END IF;
    IF p_token < cur THEN
        RAISE EXCEPTION 'pgfence: stale token %% for lease %% (current %%)', p_token, p_name, cur
            USING ERRCODE = 'PF001', DETAIL = cur::text;
    END IF;
    IF p_token > cur THEN
        RAISE EXCEPTION 'pgfence: token %% was never issued for lease %% (current %%)', p_token, p_name, cur
            USING ERRCODE = 'PF003', DETAIL = cur::text;
    END IF;
    RETURN cur;
END
$body$
$fn$, current_schema());
END
$do$;
-- +goose StatementEnd

-- pgfence_wake_waiters(name) sends the release notification blocked
-- acquirers (and runners watching their members) listen for; the payload
-- names the schema, baked in, so listeners of other schemas ignore it.
-- +goose StatementBegin
DO $do$
BEGIN
EXECUTE format($fn$
CREATE FUNCTION %1$I.pgfence_wake_waiters(p_name text) RETURNS boolean
LANGUAGE sql
AS $body$
    SELECT pg_notify('pgfence_released', json_build_object('schema', %2$L::text, 'name', p_name)::text) IS NOT NULL
$body$
$fn$, current_schema(), current_schema());
END
$do$;
-- +goose StatementEnd

-- Only the roles granted them (migrations.GrantApp) run pgfence's functions.
REVOKE EXECUTE ON FUNCTION pgfence_check(text, bigint), pgfence_wake_waiters(text),
    pgfence_sync_epoch(), pgfence_timeline(), pgfence_epoch_timeline() FROM PUBLIC;

-- +goose Down
-- Dropping the leases table destroys the token history: tokens would start
-- again from 1 and every resource fence would refuse the new leaders (or,
-- worse, a fence outside this database would accept a reissued token).
-- Refused unless the session opts in: SET pgfence.allow_token_reset = 'on'.
-- +goose StatementBegin
DO $do$
BEGIN
    IF coalesce(current_setting('pgfence.allow_token_reset', true), '') <> 'on' THEN
        RAISE EXCEPTION 'pgfence: refusing to drop pgfence_leases: it holds the token history'
            USING ERRCODE = 'PF011',
                  HINT = 'Tokens would restart at 1. To drop it anyway, SET pgfence.allow_token_reset = ''on'' in the migrating session.';
    END IF;
END
$do$;
-- +goose StatementEnd
DROP FUNCTION pgfence_wake_waiters(text);
DROP FUNCTION pgfence_check(text, bigint);
DROP FUNCTION pgfence_sync_epoch();
DROP FUNCTION pgfence_epoch_timeline();
DROP TABLE pgfence_epoch;
DROP FUNCTION pgfence_timeline();
DROP TABLE pgfence_leases;
DROP FUNCTION pgfence_leases_check_insert();
DROP FUNCTION pgfence_leases_mark_insert();
DROP FUNCTION pgfence_leases_protect();
