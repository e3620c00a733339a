-- run_head_state (0013) finds the run by its primary key. 0013's query named the run by
-- tenant, run id and session; PL/pgSQL keeps a generic plan per connection after a few
-- calls, and that plan read the run through runs_by_session (tenant, session), filtering
-- out every other run of the session: a confirmed record cost 0.17 ms in PostgreSQL for a
-- session of 50 runs and 0.98 ms for one of 5,000, where the head read of store/runs.py
-- (the run by key, its session compared after) stays flat. Now the run is read by key
-- alone and the session compared in the result: NULL, as before, for a run of another
-- session or none. What it reads is unchanged (store/runs.py _HEAD_COLUMNS;
-- tests/integration/test_kept_heads.py compares the two and checks this plan).
CREATE OR REPLACE FUNCTION run_head_state(p_tenant text, p_session uuid, p_run uuid)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT CASE WHEN r.session_id = p_session THEN concat_ws('/',
        coalesce((SELECT max(p.epoch) FROM context_plans p
                   WHERE p.tenant_id = r.tenant_id AND p.session_id = r.session_id
                     AND coalesce(p.lineage, p.epoch) = coalesce(
                         (SELECT max(m.epoch) FROM context_plans m
                           WHERE m.tenant_id = r.tenant_id AND m.session_id = r.session_id
                             AND m.epoch > r.epoch AND coalesce(m.lineage, m.epoch) = m.epoch
                             AND m.reason NOT IN ('BROWSER_PROFILE_CHANGED',
                                                  'RUN_AUTHORITY_CHANGED')),
                         (SELECT coalesce(o.lineage, o.epoch) FROM context_plans o
                           WHERE o.tenant_id = r.tenant_id AND o.session_id = r.session_id
                             AND o.epoch = r.epoch))),
                 r.epoch),
        (SELECT count(*) FROM loaded_skills s
          WHERE s.tenant_id = r.tenant_id AND s.session_id = r.session_id),
        coalesce((SELECT s.plans_revision FROM sessions s
                   WHERE s.tenant_id = r.tenant_id AND s.session_id = r.session_id), 0),
        coalesce((SELECT max(w.epoch) FROM context_plans w
                   WHERE w.tenant_id = r.tenant_id AND w.session_id = r.session_id
                     AND w.sweep), 0)) END
      FROM runs r
     WHERE r.tenant_id = p_tenant AND r.run_id = p_run);
END
$$;
