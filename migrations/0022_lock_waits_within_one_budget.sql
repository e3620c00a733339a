-- A statement that waits for several locks waits for all of them within one budget.
-- lock_timeout bounds each wait on its own, so a statement taking a person's fence and
-- then its session's row (record_model_request_waiting, 0019), or the fences of several
-- people one after another (store/snapshots.py fence_people), could wait LOCK_WAIT_SECONDS
-- for each: past the pool's command timeout (store/db.py, 10 s), which cut the statement
-- off and answered STORE_UNAVAILABLE with PostgreSQL up the whole time, where the waits
-- mean SESSION_BUSY (an audit). Before each wait these set lock_timeout to what is left of
-- the statement's budget (at least 1 ms: 0 would turn the timeout off), so the waits add
-- up to no more than the budget, and lock_timeout is left as it was for the statements
-- after (the transaction's setting, store/db.py transaction()).

-- Shared advisory locks on `p_keys`, in the order given, all before `p_deadline`;
-- lock_not_available (55P03) past it.
CREATE FUNCTION lock_shared_before(p_keys bigint[], p_deadline timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    kept text := current_setting('lock_timeout');
    k    bigint;
BEGIN
    FOREACH k IN ARRAY coalesce(p_keys, '{}') LOOP
        PERFORM set_config('lock_timeout', lock_time_left(p_deadline), true);
        PERFORM pg_advisory_xact_lock_shared(k);
    END LOOP;
    PERFORM set_config('lock_timeout', kept, true);
END
$$;

-- What is left before `p_deadline`, as a lock_timeout value (at least 1 ms).
CREATE FUNCTION lock_time_left(p_deadline timestamptz) RETURNS text
LANGUAGE sql AS $$
    SELECT greatest(1, ceil(extract(epoch FROM p_deadline - clock_timestamp()) * 1000))::bigint
           || 'ms'
$$;

-- record_model_request_waiting (0019) with its waits, the people fences then the session
-- row, within `p_wait_ms` in all. 0019's function stays for replicas of the version before.
CREATE FUNCTION record_model_request_waiting_within(
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
    p_latest      bigint,
    p_wait_ms     bigint
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    deadline timestamptz := clock_timestamp() + p_wait_ms * interval '1 millisecond';
BEGIN
    PERFORM lock_shared_before(array(
        SELECT DISTINCT hashtextextended('erasure' || chr(31) || p_tenant || chr(31) || p, 0)
               AS k
          FROM jsonb_array_elements_text(coalesce(p_request -> 'people', '[]')) AS p
         ORDER BY k), deadline);
    PERFORM set_config('lock_timeout', lock_time_left(deadline), true);
    PERFORM 1 FROM sessions WHERE tenant_id = p_tenant AND session_id = p_session FOR UPDATE;
    IF NOT run_head_holds(p_tenant, p_session, p_run, p_head, p_latest) THEN
        RETURN -4;
    END IF;
    RETURN record_model_request(p_tenant, p_session, p_epoch, p_run, p_pressure, p_used,
                                p_snapshot_id, p_trace_id, p_request);
END
$$;
