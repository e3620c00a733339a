-- The record a Build sends on its own after the shared round trip answered it -5 (busy,
-- migrations/0018; store/records.py record()). 0018 sent it through
-- record_model_request_confirmed (0013), which checks the record's kept run head before
-- taking the session's lock: the write that held the lock, which the record waited for,
-- was not seen, and a record it had made stale was written (a review). The records a
-- session's Builds made keep their arrival order but for one answered -5, which lands
-- after those that went on without it. CREATE OR REPLACE: a database migrated while this
-- function sat in 0018 already has it.
--
-- A record answered -5, sent on its own: it waits for its people fence (shared, in key
-- order) and its session row, as record_model_request takes them, and only then checks
-- its kept head, so the write it waited for (the one that held the lock) is seen; -4 if
-- that write moved the head. record_model_request then takes the locks this transaction
-- already holds.
CREATE OR REPLACE FUNCTION record_model_request_waiting(
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
    PERFORM pg_advisory_xact_lock_shared(k) FROM (
        SELECT DISTINCT hashtextextended('erasure' || chr(31) || p_tenant || chr(31) || p, 0)
               AS k
          FROM jsonb_array_elements_text(coalesce(p_request -> 'people', '[]')) AS p
         ORDER BY k) AS keys;
    PERFORM 1 FROM sessions WHERE tenant_id = p_tenant AND session_id = p_session FOR UPDATE;
    IF NOT run_head_holds(p_tenant, p_session, p_run, p_head, p_latest) THEN
        RETURN -4;
    END IF;
    RETURN record_model_request(p_tenant, p_session, p_epoch, p_run, p_pressure, p_used,
                                p_snapshot_id, p_trace_id, p_request);
END
$$;
