-- Plan lineages, continued when used (store/plans.py). A rotation every run follows but made
-- from the pinned specs (a Rotate without spec, a builder upgrade or canonicalization at an
-- admission, a Plan after an erasure) is a sweep: it continues the session's current lineage
-- at once, and each other lineage from its own head the first time a run on it builds or a
-- child pins it. Before, it rebuilt one epoch per lineage ever forked, under the session
-- lock, however few runs would build again.
--
-- `sweep` false (the default, so no backfill): every plan stored before this migration, and
-- every plan a previous version writes during a rolling update, was continued eagerly if at
-- all, so none leaves a lineage behind.
ALTER TABLE context_plans ADD COLUMN sweep boolean NOT NULL DEFAULT false;

-- A Build's head read (store/runs.py, read_run_head; store/plans.py, RUN_LINEAGE): the head
-- of a lineage, the latest merge after an epoch and the latest sweep, each an index probe
-- instead of a scan of the session's plans. The merges index's predicate inlines the
-- admission reasons exactly as RUN_LINEAGE does (core/epochs.py, ADMISSION_REASONS).
CREATE INDEX context_plans_by_lineage
    ON context_plans (tenant_id, session_id, (coalesce(lineage, epoch)), epoch);
CREATE INDEX context_plans_merges
    ON context_plans (tenant_id, session_id, epoch)
    WHERE coalesce(lineage, epoch) = epoch
      AND reason NOT IN ('BROWSER_PROFILE_CHANGED', 'RUN_AUTHORITY_CHANGED');
CREATE INDEX context_plans_sweeps ON context_plans (tenant_id, session_id, epoch) WHERE sweep;
