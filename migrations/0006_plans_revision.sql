-- Erasure rewrites persisted plans in place (their snapshot redacted, the plan marked
-- invalidated); every other plan change is a new epoch. Replicas keep the plans they read
-- (api/engine.py), so a rewrite must reach their copies: it bumps the session's revision in
-- the same transaction, a Build reads the revision in the round trip it already makes
-- (store/runs.py, read_run_head), and a kept plan of another revision is read again.
ALTER TABLE sessions ADD COLUMN plans_revision bigint NOT NULL DEFAULT 0;
