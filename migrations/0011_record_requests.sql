-- Build's write for many Builds in one round trip (store/records.py, store/batches.py):
-- record_model_request (0008) for each, in one transaction. Builds that arrive while a
-- round trip is in flight share the next one, so under load a replica pays one statement
-- and one commit for a batch instead of one per Build.
--
-- Locks are taken in the order every other writer takes them, so a batch cannot deadlock
-- with them: first the people fence of every request in the batch (shared, in key order,
-- as one request takes its own), then the session locks, one record at a time in the
-- order given. The caller passes the records sorted by (tenant, session) — the order
-- EraseSubject locks sessions in — keeping each session's records in arrival order, so
-- their sequences follow the order the Builds were made in.
--
-- Returns, per record in the order given, what record_model_request returns for it: the
-- model.request.started sequence, 0 (no request), -1 (plan invalidated), -2 (no such
-- session), -3 (a person named is erased). A refused record writes nothing and does not
-- stop the others.
CREATE FUNCTION record_model_requests(
    p_tenant      text[],
    p_session     uuid[],
    p_epoch       bigint[],
    p_run         uuid[],
    p_pressure    jsonb[],
    p_used        jsonb[],
    p_snapshot_id text[],
    p_trace_id    text[],
    p_request     jsonb[]
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    v_out bigint[] := '{}';
BEGIN
    PERFORM pg_advisory_xact_lock_shared(k) FROM (
        SELECT DISTINCT hashtextextended('erasure' || chr(31) || t || chr(31) || p, 0) AS k
          FROM unnest(p_tenant, p_request) AS r(t, request),
               jsonb_array_elements_text(coalesce(request -> 'people', '[]')) AS p
         ORDER BY k) AS keys;
    FOR i IN 1 .. coalesce(array_length(p_tenant, 1), 0) LOOP
        v_out := v_out || record_model_request(
            p_tenant[i], p_session[i], p_epoch[i], p_run[i], p_pressure[i], p_used[i],
            p_snapshot_id[i], p_trace_id[i], p_request[i]);
    END LOOP;
    RETURN v_out;
END
$$;
