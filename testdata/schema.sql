-- pgfence's schema as migrations.Up creates it: pg_dump --schema-only of a
-- migrated schema, normalised (schema renamed "pgfence", comments and
-- settings removed). Generated, do not edit: after changing a migration, run
--   go test ./migrations -run TestGoldenSchema -update
-- and review the difference.
CREATE SCHEMA pgfence;

CREATE FUNCTION pgfence.pgfence_admit(p_resource text, p_token bigint) RETURNS bigint
    LANGUAGE plpgsql
    AS $$
DECLARE
    cur bigint;
BEGIN
    SELECT f.token INTO cur FROM pgfence.pgfence_fences f WHERE f.resource = p_resource;
    IF cur = p_token THEN
        SELECT f.token INTO cur FROM pgfence.pgfence_fences f WHERE f.resource = p_resource FOR SHARE;
        IF p_token < cur THEN
            RAISE EXCEPTION 'pgfence: stale token % for resource % (highest admitted %)', p_token, p_resource, cur
                USING ERRCODE = 'PF001', DETAIL = cur::text;
        END IF;
        RETURN p_token; -- the mark only rises: here it is still p_token
    END IF;
    SELECT f.token INTO cur FROM pgfence.pgfence_fences f WHERE f.resource = p_resource FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        INSERT INTO pgfence.pgfence_fences (resource, token, updated_at)
        VALUES (p_resource, p_token, now())
        ON CONFLICT (resource) DO NOTHING;
        IF FOUND THEN
            RETURN p_token;
        END IF;
        -- A concurrent first admission inserted it: queue behind it.
        SELECT f.token INTO cur FROM pgfence.pgfence_fences f WHERE f.resource = p_resource FOR NO KEY UPDATE;
    END IF;
    IF p_token < cur THEN
        RAISE EXCEPTION 'pgfence: stale token % for resource % (highest admitted %)', p_token, p_resource, cur
            USING ERRCODE = 'PF001', DETAIL = cur::text;
    END IF;
    IF p_token > cur THEN
        UPDATE pgfence.pgfence_fences f SET token = p_token, updated_at = now() WHERE f.resource = p_resource;
    END IF;
    RETURN p_token;
END
$$;

CREATE FUNCTION pgfence.pgfence_check(p_name text, p_token bigint) RETURNS bigint
    LANGUAGE plpgsql
    AS $$
DECLARE
    cur bigint;
BEGIN
    SELECT l.token INTO cur FROM pgfence.pgfence_leases l WHERE l.name = p_name FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'pgfence: no lease named %', p_name
            USING ERRCODE = 'PF002';
    END IF;
    IF p_token < cur THEN
        RAISE EXCEPTION 'pgfence: stale token % for lease % (current %)', p_token, p_name, cur
            USING ERRCODE = 'PF001', DETAIL = cur::text;
    END IF;
    IF p_token > cur THEN
        RAISE EXCEPTION 'pgfence: token % was never issued for lease % (current %)', p_token, p_name, cur
            USING ERRCODE = 'PF003', DETAIL = cur::text;
    END IF;
    RETURN cur;
END
$$;

CREATE FUNCTION pgfence.pgfence_epoch_timeline() RETURNS bigint
    LANGUAGE sql IMMUTABLE
    AS $$SELECT N::bigint$$;

CREATE FUNCTION pgfence.pgfence_fences_protect() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF TG_OP = 'DELETE' OR TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'pgfence: resource fences are never deleted'
            USING ERRCODE = 'PF010';
    END IF;
    IF NEW.resource IS DISTINCT FROM OLD.resource OR NEW.token < OLD.token THEN
        RAISE EXCEPTION 'pgfence: fence of % cannot move backwards', OLD.resource
            USING ERRCODE = 'PF010';
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION pgfence.pgfence_leases_check_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
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

CREATE FUNCTION pgfence.pgfence_leases_mark_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
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

CREATE FUNCTION pgfence.pgfence_leases_protect() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: lease rows are never deleted (tokens must not restart)'
        USING ERRCODE = 'PF010';
END
$$;

CREATE FUNCTION pgfence.pgfence_offsets_protect() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF NEW.group_name <> OLD.group_name OR NEW.partition <> OLD.partition THEN
        RAISE EXCEPTION 'pgfence: an offset keeps its group and partition (%, %)', OLD.group_name, OLD.partition
            USING ERRCODE = 'PF010';
    END IF;
    IF NEW.token < OLD.token THEN
        RAISE EXCEPTION 'pgfence: offset of %/% is held by token %, refusing token %', OLD.group_name, OLD.partition, OLD.token, NEW.token
            USING ERRCODE = 'PF010';
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION pgfence.pgfence_runs_protect() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    RAISE EXCEPTION 'pgfence: a succeeded run stays succeeded (job %, slot %)', OLD.job, OLD.slot
        USING ERRCODE = 'PF010';
END
$$;

CREATE FUNCTION pgfence.pgfence_runs_protect_delete() RETURNS trigger
    LANGUAGE plpgsql
    AS $_$
DECLARE
    latest timestamptz;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'pgfence: the run ledger is never truncated (finished slots would run again)'
            USING ERRCODE = 'PF010';
    END IF;
    IF OLD.kind <> 'scheduled' THEN
        RETURN OLD;
    END IF;
    EXECUTE format('SELECT max(slot) FROM %I.%I WHERE job = $1 AND shard = $2 AND kind = ''scheduled''',
                   TG_TABLE_SCHEMA, TG_TABLE_NAME)
        INTO latest USING OLD.job, OLD.shard;
    IF OLD.slot >= latest THEN
        RAISE EXCEPTION 'pgfence: the latest run of job %, shard % cannot be deleted (its slot would run again)', OLD.job, OLD.shard
            USING ERRCODE = 'PF010';
    END IF;
    RETURN OLD;
END
$_$;

CREATE FUNCTION pgfence.pgfence_sync_epoch() RETURNS boolean
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    e      record;
    tl     bigint := pgfence.pgfence_timeline();
    sysid  bigint;
    clock  timestamptz;
    ms     bigint;
    last   bigint;
    seq    regclass := pg_get_serial_sequence('pgfence.pgfence_leases', 'token')::regclass;
BEGIN
    SELECT s.system_identifier INTO sysid FROM pg_control_system() s;
    SELECT * INTO e FROM pgfence.pgfence_epoch;
    IF e.system_identifier = sysid AND e.timeline = tl AND pgfence.pgfence_epoch_timeline() = tl THEN
        RETURN true;
    END IF;
    SELECT * INTO e FROM pgfence.pgfence_epoch FOR UPDATE;
    IF e.system_identifier <> sysid OR e.timeline <> tl THEN
        clock := clock_timestamp();
        ms := floor(extract(epoch FROM clock - timestamptz '2026-01-01 00:00:00+00') * 1000)::bigint;
        last := coalesce(pg_sequence_last_value(seq), 0);
        IF ms >= 1::bigint << 41 THEN
            RAISE EXCEPTION 'pgfence: the server''s clock (%) is beyond the last token epoch (2095)', clock
                USING ERRCODE = 'PF012';
        END IF;
        IF ms < 0 OR ms << 22 <= last THEN
            RAISE EXCEPTION 'pgfence: the server''s clock (%) is behind the newest token issued (%, from %): tokens of a lost history could repeat', clock, last,
                    timestamptz '2026-01-01 00:00:00+00' + ((last >> 22) * interval '1 millisecond')
                USING ERRCODE = 'PF013',
                      HINT = 'Synchronise the servers'' clocks (NTP); acquisitions go on once this server''s clock has passed the newest token''s.';
        END IF;
        PERFORM setval(seq, ms << 22, false);
        UPDATE pgfence.pgfence_epoch SET timeline = tl, system_identifier = sysid, started_at = clock, first_token = ms << 22;
    END IF;
    IF pgfence.pgfence_epoch_timeline() IS DISTINCT FROM tl THEN
        EXECUTE format('CREATE OR REPLACE FUNCTION %I.pgfence_epoch_timeline() RETURNS bigint LANGUAGE sql IMMUTABLE AS %L',
            'pgfence', 'SELECT ' || tl || '::bigint');
    END IF;
    RETURN true;
END
$$;

CREATE FUNCTION pgfence.pgfence_timeline() RETURNS bigint
    LANGUAGE sql
    AS $$
    SELECT ('x' || left(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 8))::bit(32)::bigint
$$;

CREATE FUNCTION pgfence.pgfence_wake_waiters(p_name text) RETURNS boolean
    LANGUAGE sql
    AS $$
    SELECT pg_notify('pgfence_released', json_build_object('schema', 'pgfence'::text, 'name', p_name)::text) IS NOT NULL
$$;

CREATE TABLE pgfence.pgfence_db_version (
    id integer NOT NULL,
    version_id bigint NOT NULL,
    is_applied boolean NOT NULL,
    tstamp timestamp without time zone DEFAULT now() NOT NULL
);

ALTER TABLE pgfence.pgfence_db_version ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY (
    SEQUENCE NAME pgfence.pgfence_db_version_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE pgfence.pgfence_epoch (
    one boolean DEFAULT true NOT NULL,
    timeline bigint NOT NULL,
    system_identifier bigint NOT NULL,
    started_at timestamp with time zone NOT NULL,
    first_token bigint NOT NULL,
    CONSTRAINT pgfence_epoch_one_check CHECK (one)
);

CREATE TABLE pgfence.pgfence_fences (
    resource text NOT NULL,
    token bigint NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT pgfence_fences_resource_check CHECK (((octet_length(resource) >= 1) AND (octet_length(resource) <= 255))),
    CONSTRAINT pgfence_fences_token_check CHECK ((token >= 1))
);

CREATE TABLE pgfence.pgfence_groups (
    group_name text NOT NULL,
    partitions integer NOT NULL,
    registered_at timestamp with time zone NOT NULL,
    registered_by text NOT NULL,
    next_partitions integer,
    cut_offset bigint,
    change_at timestamp with time zone,
    change_by text,
    CONSTRAINT pgfence_groups_check CHECK (((next_partitions IS NULL) = (cut_offset IS NULL))),
    CONSTRAINT pgfence_groups_next_partitions_check CHECK (((next_partitions >= 1) AND (next_partitions <= 65536))),
    CONSTRAINT pgfence_groups_partitions_check CHECK (((partitions >= 1) AND (partitions <= 65536)))
);

CREATE TABLE pgfence.pgfence_instances (
    id text NOT NULL,
    started_at timestamp with time zone NOT NULL,
    heartbeat_at timestamp with time zone NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    jobs text[] DEFAULT '{}'::text[] NOT NULL,
    stopped_at timestamp with time zone,
    CONSTRAINT pgfence_instances_id_check CHECK (((octet_length(id) >= 1) AND (octet_length(id) <= 255)))
);

CREATE TABLE pgfence.pgfence_jobs (
    job text NOT NULL,
    schedule text NOT NULL,
    shards integer NOT NULL,
    max_attempts integer NOT NULL,
    registered_at timestamp with time zone NOT NULL,
    registered_by text NOT NULL,
    paused_at timestamp with time zone,
    paused_by text,
    CONSTRAINT pgfence_jobs_max_attempts_check CHECK ((max_attempts >= 1)),
    CONSTRAINT pgfence_jobs_shards_check CHECK ((shards >= 0))
);

CREATE TABLE pgfence.pgfence_leases (
    name text NOT NULL,
    token bigint NOT NULL,
    holder text,
    secret bytea,
    acquired_at timestamp with time zone NOT NULL,
    waiters_until timestamp with time zone,
    observers_until timestamp with time zone,
    session bigint,
    freed_at timestamp with time zone
)
WITH (fillfactor='10');

CREATE TABLE pgfence.pgfence_sessions (
    id bigint NOT NULL,
    holder text NOT NULL,
    started_at timestamp with time zone NOT NULL,
    renewed_at timestamp with time zone NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    losses bigint DEFAULT 0 NOT NULL
)
WITH (fillfactor='50');

CREATE VIEW pgfence.pgfence_lease_states AS
 SELECT l.name,
    l.token,
    l.holder,
    l.session,
    l.acquired_at,
    COALESCE(s.renewed_at, l.acquired_at) AS renewed_at,
        CASE
            WHEN (l.session IS NULL) THEN l.freed_at
            ELSE s.expires_at
        END AS expires_at
   FROM (pgfence.pgfence_leases l
     LEFT JOIN pgfence.pgfence_sessions s ON ((s.id = l.session)));

ALTER TABLE pgfence.pgfence_leases ALTER COLUMN token ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME pgfence.pgfence_leases_token_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE pgfence.pgfence_offsets (
    group_name text NOT NULL,
    partition integer NOT NULL,
    committed_offset bigint DEFAULT 0 NOT NULL,
    token bigint DEFAULT 0 NOT NULL,
    holder text,
    advanced_at timestamp with time zone,
    committed_at timestamp with time zone,
    commits bigint DEFAULT 0 NOT NULL,
    end_offset bigint,
    end_at timestamp with time zone,
    until_offset bigint,
    CONSTRAINT pgfence_offsets_partition_check CHECK ((partition >= 0)),
    CONSTRAINT pgfence_offsets_token_check CHECK ((token >= 0))
);

CREATE TABLE pgfence.pgfence_runs (
    job text NOT NULL,
    shard integer NOT NULL,
    kind text NOT NULL,
    slot timestamp with time zone NOT NULL,
    attempt integer NOT NULL,
    token bigint,
    status text NOT NULL,
    holder text NOT NULL,
    requested_by text,
    started_at timestamp with time zone NOT NULL,
    finished_at timestamp with time zone,
    error text,
    CONSTRAINT pgfence_runs_attempt_check CHECK ((attempt >= 1)),
    CONSTRAINT pgfence_runs_check CHECK (((status = 'pending'::text) = (token IS NULL))),
    CONSTRAINT pgfence_runs_kind_check CHECK ((kind = ANY (ARRAY['scheduled'::text, 'manual'::text]))),
    CONSTRAINT pgfence_runs_shard_check CHECK ((shard >= 0)),
    CONSTRAINT pgfence_runs_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'running'::text, 'succeeded'::text, 'failed'::text, 'panicked'::text, 'fenced'::text, 'skipped'::text]))),
    CONSTRAINT pgfence_runs_token_check CHECK ((token >= 1))
);

CREATE TABLE pgfence.pgfence_session_losses (
    session bigint NOT NULL,
    name text NOT NULL,
    lost_at timestamp with time zone NOT NULL
);

ALTER TABLE pgfence.pgfence_sessions ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME pgfence.pgfence_sessions_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

CREATE TABLE pgfence.pgfence_terms (
    kind text NOT NULL,
    name text NOT NULL,
    shard integer NOT NULL,
    token bigint NOT NULL,
    holder text NOT NULL,
    started_at timestamp with time zone NOT NULL,
    ended_at timestamp with time zone,
    end_cause text,
    CONSTRAINT pgfence_terms_check CHECK (((ended_at IS NULL) = (end_cause IS NULL))),
    CONSTRAINT pgfence_terms_kind_check CHECK ((kind = ANY (ARRAY['job'::text, 'group'::text]))),
    CONSTRAINT pgfence_terms_shard_check CHECK ((shard >= 0))
);

ALTER TABLE ONLY pgfence.pgfence_db_version
    ADD CONSTRAINT pgfence_db_version_pkey PRIMARY KEY (id);

ALTER TABLE ONLY pgfence.pgfence_epoch
    ADD CONSTRAINT pgfence_epoch_pkey PRIMARY KEY (one);

ALTER TABLE ONLY pgfence.pgfence_fences
    ADD CONSTRAINT pgfence_fences_pkey PRIMARY KEY (resource);

ALTER TABLE ONLY pgfence.pgfence_groups
    ADD CONSTRAINT pgfence_groups_pkey PRIMARY KEY (group_name);

ALTER TABLE ONLY pgfence.pgfence_instances
    ADD CONSTRAINT pgfence_instances_pkey PRIMARY KEY (id);

ALTER TABLE ONLY pgfence.pgfence_jobs
    ADD CONSTRAINT pgfence_jobs_pkey PRIMARY KEY (job);

ALTER TABLE ONLY pgfence.pgfence_leases
    ADD CONSTRAINT pgfence_leases_pkey PRIMARY KEY (name);

ALTER TABLE ONLY pgfence.pgfence_offsets
    ADD CONSTRAINT pgfence_offsets_pkey PRIMARY KEY (group_name, partition);

ALTER TABLE ONLY pgfence.pgfence_runs
    ADD CONSTRAINT pgfence_runs_pkey PRIMARY KEY (job, shard, kind, slot, attempt);

ALTER TABLE ONLY pgfence.pgfence_sessions
    ADD CONSTRAINT pgfence_sessions_pkey PRIMARY KEY (id);

ALTER TABLE ONLY pgfence.pgfence_terms
    ADD CONSTRAINT pgfence_terms_pkey PRIMARY KEY (kind, name, shard, token);

CREATE INDEX pgfence_instances_expires ON pgfence.pgfence_instances USING btree (expires_at);

CREATE INDEX pgfence_runs_pending ON pgfence.pgfence_runs USING btree (job, shard) WHERE (status = 'pending'::text);

CREATE INDEX pgfence_runs_recent ON pgfence.pgfence_runs USING btree (started_at DESC);

CREATE INDEX pgfence_session_losses_session ON pgfence.pgfence_session_losses USING btree (session);

CREATE INDEX pgfence_sessions_expires ON pgfence.pgfence_sessions USING btree (expires_at);

CREATE INDEX pgfence_terms_started ON pgfence.pgfence_terms USING btree (started_at);

CREATE TRIGGER pgfence_fences_protect_delete BEFORE DELETE ON pgfence.pgfence_fences FOR EACH ROW EXECUTE FUNCTION pgfence.pgfence_fences_protect();

CREATE TRIGGER pgfence_fences_protect_truncate BEFORE TRUNCATE ON pgfence.pgfence_fences FOR EACH STATEMENT EXECUTE FUNCTION pgfence.pgfence_fences_protect();

CREATE TRIGGER pgfence_fences_protect_update BEFORE UPDATE ON pgfence.pgfence_fences FOR EACH ROW WHEN (((new.token < old.token) OR (new.resource IS DISTINCT FROM old.resource))) EXECUTE FUNCTION pgfence.pgfence_fences_protect();

CREATE TRIGGER pgfence_leases_check_insert BEFORE INSERT ON pgfence.pgfence_leases FOR EACH ROW EXECUTE FUNCTION pgfence.pgfence_leases_check_insert();

CREATE TRIGGER pgfence_leases_mark_insert BEFORE INSERT ON pgfence.pgfence_leases FOR EACH STATEMENT EXECUTE FUNCTION pgfence.pgfence_leases_mark_insert();

CREATE TRIGGER pgfence_leases_protect_delete BEFORE DELETE ON pgfence.pgfence_leases FOR EACH ROW EXECUTE FUNCTION pgfence.pgfence_leases_protect();

CREATE TRIGGER pgfence_leases_protect_truncate BEFORE TRUNCATE ON pgfence.pgfence_leases FOR EACH STATEMENT EXECUTE FUNCTION pgfence.pgfence_leases_protect();

CREATE TRIGGER pgfence_offsets_protect BEFORE UPDATE ON pgfence.pgfence_offsets FOR EACH ROW EXECUTE FUNCTION pgfence.pgfence_offsets_protect();

CREATE TRIGGER pgfence_runs_protect BEFORE UPDATE ON pgfence.pgfence_runs FOR EACH ROW WHEN (((old.status = 'succeeded'::text) AND (new.* IS DISTINCT FROM old.*))) EXECUTE FUNCTION pgfence.pgfence_runs_protect();

CREATE TRIGGER pgfence_runs_protect_delete BEFORE DELETE ON pgfence.pgfence_runs FOR EACH ROW EXECUTE FUNCTION pgfence.pgfence_runs_protect_delete();

CREATE TRIGGER pgfence_runs_protect_truncate BEFORE TRUNCATE ON pgfence.pgfence_runs FOR EACH STATEMENT EXECUTE FUNCTION pgfence.pgfence_runs_protect_delete();
