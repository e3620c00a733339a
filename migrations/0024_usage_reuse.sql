-- History reuse per usage report (api/usage.py, Rule 6): the report's cache-read tokens
-- against the full input the preceding request read, in parts per million; NULL when
-- unmeasured (no preceding request, or it was not reported yet). A column of its own, not a
-- key of the stored response: the previous version answers a replay by reading that
-- response into its own fields and would fail on a key it does not know, while it inserts
-- its reports naming its columns, so it keeps working beside this one (its rows have NULL
-- here). Nullable without a default: no table rewrite.
ALTER TABLE usage_reports ADD COLUMN reuse_ppm bigint;
