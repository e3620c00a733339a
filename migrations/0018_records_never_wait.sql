-- Build's shared record round trip never waits for a lock (store/records.py,
-- store/batches.py). A replica sends its Builds' records one round trip at a time; a round
-- trip that waited for one session's lock (a CommitCompaction, an admission or an erasure
-- holding it) held every other Build of the replica behind it, whatever their session or
-- tenant, and the session locks it had already taken blocked those sessions' writes on
-- every replica (an audit: an unrelated session's Build took 19.5 s and failed
-- UNAVAILABLE when one session's lock was held for 21 s).
--
-- record_model_requests_nowait is record_model_requests_confirmed (0013) that takes each
-- record's locks only when it can have them at once: its people fence
-- (pg_try_advisory_xact_lock_shared) and its session row (FOR UPDATE SKIP LOCKED). A
-- record whose lock is held elsewhere is answered -5 and writes nothing; the engine sends
-- it again on its own connection, outside the shared round trips, where it waits for its
-- own session only (record_model_request_confirmed, 0013). Not waiting, the round trip
-- cannot deadlock whatever order it meets locks in; the records are still sent sorted by
-- (tenant, session) so a session's records keep their arrival order.
--
-- p_head[i] NULL: nothing to confirm for that record (run_head_holds, 0013). The locks a
-- record takes here are taken again by record_model_request, which this transaction
-- already holds, so that takes them without waiting.
CREATE FUNCTION record_model_requests_nowait(
    p_tenant      text[],
    p_session     uuid[],
    p_epoch       bigint[],
    p_run         uuid[],
    p_pressure    jsonb[],
    p_used        jsonb[],
    p_snapshot_id text[],
    p_trace_id    text[],
    p_request     jsonb[],
    p_head        text[],
    p_latest      bigint[]
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    v_out  bigint[] := '{}';
    v_free boolean;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_tenant, 1), 0) LOOP
        -- Every person's fence, shared, if no erasure holds it.
        SELECT coalesce(bool_and(pg_try_advisory_xact_lock_shared(k)), true) INTO v_free
          FROM (SELECT DISTINCT
                       hashtextextended('erasure' || chr(31) || p_tenant[i] || chr(31) || p, 0)
                       AS k
                  FROM jsonb_array_elements_text(coalesce(p_request[i] -> 'people', '[]')) AS p
                 ORDER BY k) AS keys;
        IF v_free THEN
            PERFORM 1 FROM sessions
             WHERE tenant_id = p_tenant[i] AND session_id = p_session[i]
               FOR UPDATE SKIP LOCKED;
            -- Skipped, or no such session (record_model_request answers that: -2).
            v_free := FOUND OR NOT EXISTS (
                SELECT 1 FROM sessions
                 WHERE tenant_id = p_tenant[i] AND session_id = p_session[i]);
        END IF;
        IF NOT v_free THEN
            v_out := v_out || -5::bigint;
        ELSIF NOT run_head_holds(p_tenant[i], p_session[i], p_run[i], p_head[i], p_latest[i])
        THEN
            v_out := v_out || -4::bigint;
        ELSE
            v_out := v_out || record_model_request(
                p_tenant[i], p_session[i], p_epoch[i], p_run[i], p_pressure[i], p_used[i],
                p_snapshot_id[i], p_trace_id[i], p_request[i]);
        END IF;
    END LOOP;
    RETURN v_out;
END
$$;
