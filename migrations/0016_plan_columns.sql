-- Two columns of context_plans generated from the stored plan, so the queries that need
-- them read a column instead of the plan, which is over PostgreSQL's 2 kB inline limit for
-- any real roster: reading a key out of it fetches its TOAST chunks and decompresses all
-- of it. Both are generated, so every writer that sets the plan or its spec (a new epoch,
-- an erasure's redaction, store/snapshots.py) keeps them right without naming them.
--
-- `invalidated`: record_model_request (0008) read plan->>'invalidated' on every Build's
-- record. Measured on the transport benchmark's 12 kB plan (5 kB compressed): 10.3 us for
-- that read against 2.8 us for the plan's key alone, and it grows with the plan.
--
-- `prefix_content_key`: what the plan's enveloped prefix entries hold (core/plan.py
-- prefix_data): the id of every system block, and the spec's memory snapshot items, skills
-- and tools their content comes from. Plans of one key show the same content (each plan's
-- own secret still gives its envelopes their own nonces, so their prefix hashes differ).
-- Compaction reads one plan per key of the plans a run's Builds were made on
-- (store/plans.py read_distinct_prefixes): a session of thousands of admission forks
-- over one snapshot decodes one plan, not thousands, under the session lock.
--
-- Adding stored generated columns rewrites context_plans (once for both) under an ACCESS
-- EXCLUSIVE lock, which blocks every read of plans too while it runs: Builds (their head
-- reads and records), StartRun, GetPlan, GetBuild, ReportUsage, compaction and erasures,
-- as well as Plan and Rotate. On a large context_plans, run `migrate` at a quiet time
-- (docs/operations.md, Migrations).
ALTER TABLE context_plans
    ADD COLUMN invalidated boolean
        GENERATED ALWAYS AS (coalesce((plan ->> 'invalidated')::boolean, false)) STORED,
    ADD COLUMN prefix_content_key text
        GENERATED ALWAYS AS (md5(
            coalesce(jsonb_path_query_array(plan, '$.system[*].item_id')::text, '')
            || chr(31) || coalesce((spec -> 'snapshot' -> 'items')::text, '')
            || chr(31) || coalesce((spec -> 'skills')::text, '')
            || chr(31) || coalesce((spec -> 'tools')::text, ''))) STORED;

-- record_model_request (0008) reading the column; otherwise unchanged. Same signature, so
-- the previous version, which calls it too, keeps working beside this one.
CREATE OR REPLACE FUNCTION record_model_request(
    p_tenant      text,
    p_session     uuid,
    p_epoch       bigint,
    p_run         uuid,
    p_pressure    jsonb,
    p_used        jsonb,
    p_snapshot_id text,
    p_trace_id    text,
    p_request     jsonb
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_seq  bigint;
    v_bind boolean := false;
BEGIN
    IF p_request IS NOT NULL AND jsonb_array_length(coalesce(p_request -> 'people', '[]')) > 0
    THEN
        PERFORM pg_advisory_xact_lock_shared(k) FROM (
            SELECT DISTINCT hashtextextended('erasure' || chr(31) || p_tenant || chr(31) || p, 0)
                   AS k
              FROM jsonb_array_elements_text(p_request -> 'people') AS p
             ORDER BY k) AS keys;
        -- A new statement, so a fresh snapshot: an erasure that committed while this
        -- waited for the lock is seen.
        IF EXISTS (
            SELECT 1 FROM erased_people e
             WHERE e.tenant_id = p_tenant
               AND e.person_sha256 IN (
                   SELECT encode(sha256(convert_to(p, 'UTF8')), 'hex')
                     FROM jsonb_array_elements_text(p_request -> 'people') AS p)) THEN
            RETURN -3;
        END IF;
    END IF;
    SELECT last_sequence INTO v_seq FROM sessions
     WHERE tenant_id = p_tenant AND session_id = p_session FOR UPDATE;
    IF NOT FOUND THEN
        RETURN -2;
    END IF;
    IF p_request IS NOT NULL THEN
        IF coalesce((SELECT invalidated FROM context_plans
                      WHERE tenant_id = p_tenant AND session_id = p_session
                        AND epoch = p_epoch), false) THEN
            RETURN -1;
        END IF;
        v_bind := p_used IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM snapshot_usages
             WHERE tenant_id = p_tenant AND run_id = p_run AND epoch = p_epoch);
    END IF;
    IF p_pressure IS NOT NULL THEN
        v_seq := v_seq + 1;
        INSERT INTO session_events (tenant_id, session_id, sequence, type, run_id, payload)
        VALUES (p_tenant, p_session, v_seq, 'context.budget.pressure', p_run, p_pressure);
    END IF;
    IF v_bind THEN
        v_seq := v_seq + 1;
        INSERT INTO session_events (tenant_id, session_id, sequence, type, run_id, payload)
        VALUES (p_tenant, p_session, v_seq, 'context.snapshot.used', p_run, p_used);
        INSERT INTO snapshot_usages
            (tenant_id, session_id, run_id, epoch, snapshot_id, recall_trace_id, sequence)
        VALUES (p_tenant, p_session, p_run, p_epoch, p_snapshot_id, p_trace_id, v_seq);
    END IF;
    IF p_request IS NOT NULL THEN
        v_seq := v_seq + 1;
        INSERT INTO session_events (tenant_id, session_id, sequence, type, run_id, payload)
        VALUES (p_tenant, p_session, v_seq, 'model.request.started', p_run, p_request);
    END IF;
    UPDATE sessions SET last_sequence = v_seq
     WHERE tenant_id = p_tenant AND session_id = p_session;
    RETURN CASE WHEN p_request IS NULL THEN 0 ELSE v_seq END;
END
$$;
