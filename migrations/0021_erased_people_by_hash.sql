-- 0007 was rewritten an hour after it first landed, to keep erased people as the SHA-256
-- of their id (`person_sha256`) rather than the id (`person_id`). A database migrated in
-- that hour kept the first version's column, which nothing reads or writes: every erasure
-- and every check of a snapshot or recall against erased people failed. This moves such a
-- database to the released shape, hashing the ids it holds as store/snapshots.py does
-- (SHA-256 of the UTF-8 id, hex); where both columns exist (a hand-made repair), the ids
-- are hashed into the rows that lack a hash and the id column dropped; on any other
-- database it changes nothing.
DO $$
DECLARE
    has_id boolean;
    has_hash boolean;
BEGIN
    -- The table the search path finds, as the statements below name it.
    SELECT coalesce(bool_or(attname = 'person_id'), false),
           coalesce(bool_or(attname = 'person_sha256'), false)
      INTO has_id, has_hash
      FROM pg_attribute
     WHERE attrelid = to_regclass('erased_people') AND NOT attisdropped;
    IF has_id AND NOT has_hash THEN
        ALTER TABLE erased_people RENAME COLUMN person_id TO person_sha256;
        UPDATE erased_people
           SET person_sha256 = encode(sha256(convert_to(person_sha256, 'UTF8')), 'hex');
    ELSIF has_id AND has_hash THEN
        UPDATE erased_people
           SET person_sha256 = encode(sha256(convert_to(person_id, 'UTF8')), 'hex')
         WHERE person_sha256 IS NULL;
        -- The primary key was on the id: it goes with it, and is made on the hash.
        ALTER TABLE erased_people DROP COLUMN person_id;
        ALTER TABLE erased_people ALTER COLUMN person_sha256 SET NOT NULL,
            ADD PRIMARY KEY (tenant_id, person_sha256);
    END IF;
END
$$;
