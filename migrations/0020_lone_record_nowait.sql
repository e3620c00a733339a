-- A lone record in Build's shared round trip (store/records.py): record_model_requests_nowait
-- (0018) for one record, without the arrays, and without the people fence's query when the
-- request names no one. Most records go alone (a replica whose Builds do not overlap: a
-- sidecar's), and through the array function one cost PostgreSQL about 65 us more than
-- the single-record statement before 0018 (a review; 408 against 344 us a call here, and
-- 365 us through this one). Same answers: the sequence, or -5 (busy) when another
-- transaction holds a lock it needs, -4 (stale head), or record_model_request's refusals.
CREATE FUNCTION record_model_request_nowait(
    p_tenant      text,
    p_session     uuid,
    p_epoch       bigint,
    p_run         uuid,
    p_pressure    jsonb,
    p_used        jsonb,
    p_snapshot_id text,
    p_trace_id    text,
    p_request     jsonb,
    p_head        text,
    p_latest      bigint
) RETURNS bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF p_request IS NOT NULL AND jsonb_array_length(coalesce(p_request -> 'people', '[]')) > 0
    THEN
        IF NOT (SELECT bool_and(pg_try_advisory_xact_lock_shared(k)) FROM (
                    SELECT DISTINCT hashtextextended(
                               'erasure' || chr(31) || p_tenant || chr(31) || p, 0) AS k
                      FROM jsonb_array_elements_text(p_request -> 'people') AS p
                     ORDER BY k) AS keys) THEN
            RETURN -5;
        END IF;
    END IF;
    PERFORM 1 FROM sessions
     WHERE tenant_id = p_tenant AND session_id = p_session FOR UPDATE SKIP LOCKED;
    IF NOT FOUND AND EXISTS (SELECT 1 FROM sessions
                              WHERE tenant_id = p_tenant AND session_id = p_session) THEN
        RETURN -5;
    END IF;
    IF NOT run_head_holds(p_tenant, p_session, p_run, p_head, p_latest) THEN
        RETURN -4;
    END IF;
    RETURN record_model_request(p_tenant, p_session, p_epoch, p_run, p_pressure, p_used,
                                p_snapshot_id, p_trace_id, p_request);
END
$$;
