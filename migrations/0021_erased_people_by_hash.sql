-- 0007 was rewritten an hour after it first landed, to keep erased people as the SHA-256
-- of their id (`person_sha256`) rather than the id (`person_id`). A database migrated in
-- that hour kept the first version's column, which nothing reads or writes: every erasure
-- and every check of a snapshot or recall against erased people failed. This moves such a
-- database to the released shape, hashing the ids it holds as store/snapshots.py does
-- (SHA-256 of the UTF-8 id, hex); on any other database it changes nothing.
DO $$
BEGIN
    IF EXISTS (
        SELECT FROM information_schema.columns
         WHERE table_schema = current_schema() AND table_name = 'erased_people'
           AND column_name = 'person_id'
    ) THEN
        ALTER TABLE erased_people RENAME COLUMN person_id TO person_sha256;
        UPDATE erased_people
           SET person_sha256 = encode(sha256(convert_to(person_sha256, 'UTF8')), 'hex');
    END IF;
END
$$;
