-- The change log a version before the change feed installed (guard_changes numbered under a
-- lock on guard_feed): tests/app/test_feed_upgrade.py installs it and starts the current one.

CREATE TABLE IF NOT EXISTS "guard_changes" (id bigint PRIMARY KEY, op char(1) NOT NULL CHECK (op IN ('i', 'd')), key text NOT NULL);

CREATE TABLE IF NOT EXISTS "guard_feed" (source bigint NOT NULL, last_id bigint NOT NULL);

CREATE OR REPLACE FUNCTION "guard_records_insert"() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $guard$
DECLARE base bigint; n bigint;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM new_rows) THEN RETURN NULL; END IF;
  SELECT last_id INTO base FROM "guard_feed" FOR UPDATE;
  INSERT INTO "guard_changes" (id, op, key)
    SELECT base + row_number() OVER (), 'i', "key"::text FROM new_rows;
  GET DIAGNOSTICS n = ROW_COUNT;
  UPDATE "guard_feed" SET last_id = base + n;
  PERFORM pg_notify('guard_changes', (base + n)::text);
  RETURN NULL;
END$guard$;

CREATE OR REPLACE FUNCTION "guard_records_delete"() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $guard$
DECLARE base bigint; n bigint;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM old_rows) THEN RETURN NULL; END IF;
  SELECT last_id INTO base FROM "guard_feed" FOR UPDATE;
  INSERT INTO "guard_changes" (id, op, key)
    SELECT base + row_number() OVER (), 'd', "key"::text FROM old_rows;
  GET DIAGNOSTICS n = ROW_COUNT;
  UPDATE "guard_feed" SET last_id = base + n;
  PERFORM pg_notify('guard_changes', (base + n)::text);
  RETURN NULL;
END$guard$;

CREATE OR REPLACE FUNCTION "guard_records_update"() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $guard$
DECLARE base bigint;
BEGIN
  SELECT last_id INTO base FROM "guard_feed" FOR UPDATE;
  INSERT INTO "guard_changes" (id, op, key)
    VALUES (base + 1, 'd', OLD."key"::text), (base + 2, 'i', NEW."key"::text);
  UPDATE "guard_feed" SET last_id = base + 2;
  PERFORM pg_notify('guard_changes', (base + 2)::text);
  RETURN NULL;
END$guard$;

CREATE OR REPLACE FUNCTION "guard_records_truncate"() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $guard$
DECLARE base bigint; n bigint;
BEGIN
  IF NOT EXISTS (SELECT 1 FROM "records") THEN RETURN NULL; END IF;
  SELECT last_id INTO base FROM "guard_feed" FOR UPDATE;
  INSERT INTO "guard_changes" (id, op, key)
    SELECT base + row_number() OVER (), 'd', "key"::text FROM "records";
  GET DIAGNOSTICS n = ROW_COUNT;
  UPDATE "guard_feed" SET last_id = base + n;
  PERFORM pg_notify('guard_changes', (base + n)::text);
  RETURN NULL;
END$guard$;

CREATE OR REPLACE TRIGGER "guard_records_insert" AFTER INSERT ON "records" REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION "guard_records_insert"();

CREATE OR REPLACE TRIGGER "guard_records_delete" AFTER DELETE ON "records" REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION "guard_records_delete"();

CREATE OR REPLACE TRIGGER "guard_records_update" AFTER UPDATE OF "key" ON "records" FOR EACH ROW WHEN (OLD."key" IS DISTINCT FROM NEW."key") EXECUTE FUNCTION "guard_records_update"();

CREATE OR REPLACE TRIGGER "guard_records_truncate" BEFORE TRUNCATE ON "records" FOR EACH STATEMENT EXECUTE FUNCTION "guard_records_truncate"();

