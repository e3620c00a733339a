-- 0016 was renamed a few commits after it first landed: 0016_plan_invalidated added the
-- `invalidated` column alone, and 0016_plan_columns, which replaced it, adds that column
-- and `prefix_content_key` in one rewrite. A database migrated in between has the first
-- name recorded, so 0016_plan_columns is pending there and failed on its first column,
-- already present: the database could never migrate again, and lacked the second column
-- compaction reads (an audit). This runs before it (the names sort so) and, on such a
-- database only, drops the first column, which 0016_plan_columns then adds back with its
-- companion and the functions that read it. Everywhere else it does nothing.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM schema_migrations WHERE version = '0016_plan_invalidated')
       AND NOT EXISTS (SELECT 1 FROM schema_migrations WHERE version = '0016_plan_columns')
    THEN
        ALTER TABLE context_plans DROP COLUMN IF EXISTS invalidated;
    END IF;
END
$$;
