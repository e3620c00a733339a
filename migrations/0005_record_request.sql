-- Build's one write, as one statement: the session lock, the erasure fence, the snapshot
-- binding and the events, in a single round trip. A Build used to hold the session row
-- lock across six round trips, so concurrent Builds of one session queued behind each
-- other for the length of all six; here the lock is held only while this function runs
-- inside the server. Each statement below reads a fresh snapshot (READ COMMITTED), taken
-- after the lock is granted, so the invalidation it reads is the committed one.
--
-- Returns the model.request.started sequence; 0 when p_request is NULL (no request was
-- built: only the pressure event is recorded); -1 when an erasure invalidated the plan
-- (nothing is written); -2 when the session does not exist.
CREATE FUNCTION record_model_request(
    p_tenant      text,
    p_session     uuid,
    p_epoch       bigint,
    p_run         uuid,
    p_pressure    jsonb,  -- context.budget.pressure payload, or NULL when no yield ran
    p_used        jsonb,  -- context.snapshot.used payload, or NULL for an empty snapshot
    p_snapshot_id text,
    p_trace_id    text,
    p_request     jsonb   -- model.request.started payload, or NULL (needs compaction)
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_seq  bigint;
    v_bind boolean := false;
BEGIN
    SELECT last_sequence INTO v_seq FROM sessions
     WHERE tenant_id = p_tenant AND session_id = p_session FOR UPDATE;
    IF NOT FOUND THEN
        RETURN -2;
    END IF;
    IF p_request IS NOT NULL THEN
        IF coalesce((SELECT (plan->>'invalidated')::boolean FROM context_plans
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
