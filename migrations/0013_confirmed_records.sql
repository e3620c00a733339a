-- Build's write confirming the run head it was made from (store/records.py, api/engine.py).
-- A replica keeps the head it read for a run's Build; the run's next Build on that replica
-- is made from the kept head and, instead of reading the head again in a round trip of its
-- own, hands the record what the head said. The record is written only if the run's head
-- is still that; else it writes nothing, answers -4, and the engine builds again from a
-- head read afresh. One round trip per Build instead of two.

-- What a Build depends on in a run's head besides the checkpoint version, as text:
-- effective epoch / skills loaded / plans revision / latest sweep, normalized as
-- store/runs.py run_head_of normalizes the head read (RunHead.state). The reads are those
-- of store/runs.py _HEAD_COLUMNS, the lineage inlined as store/plans.py RUN_LINEAGE
-- inlines it; tests/integration/test_kept_heads.py checks both give the same head
-- through appends, rotations, skill loads and revisions. NULL for no such run in the
-- session.
--
-- PL/pgSQL, not SQL: a SQL function that is not inlined plans its query on every call,
-- and planning this one costs more than running it; PL/pgSQL keeps the plan per connection.
CREATE FUNCTION run_head_state(p_tenant text, p_session uuid, p_run uuid) RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT concat_ws('/',
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
                     AND w.sweep), 0))
      FROM runs r
     WHERE r.tenant_id = p_tenant AND r.run_id = p_run AND r.session_id = p_session);
END
$$;

-- A run's latest checkpoint version (RunHead.latest_version), 0 for none.
CREATE FUNCTION run_latest_version(p_tenant text, p_run uuid) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT coalesce(max(c.version), 0) FROM run_checkpoints c
             WHERE c.tenant_id = p_tenant AND c.run_id = p_run);
END
$$;

-- Whether the run's head is still the one a record carries (p_head NULL: none to
-- confirm; p_latest NULL: its latest version does not matter).
CREATE FUNCTION run_head_holds(
    p_tenant text, p_session uuid, p_run uuid, p_head text, p_latest bigint
) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN p_head IS NULL OR (
        run_head_state(p_tenant, p_session, p_run) IS NOT DISTINCT FROM p_head
        AND (p_latest IS NULL OR run_latest_version(p_tenant, p_run) = p_latest));
END
$$;

-- record_model_request (0008) of one record whose head holds, else -4 and nothing written:
-- a lone Build's write, without the batch's arrays.
CREATE FUNCTION record_model_request_confirmed(
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
    IF NOT run_head_holds(p_tenant, p_session, p_run, p_head, p_latest) THEN
        RETURN -4;
    END IF;
    RETURN record_model_request(p_tenant, p_session, p_epoch, p_run, p_pressure, p_used,
                                p_snapshot_id, p_trace_id, p_request);
END
$$;

-- record_model_requests (0011) for the records whose expected head is still the run's:
-- p_head[i] its run_head_state (NULL: a head read for that Build, nothing to confirm) and
-- p_latest[i] its latest checkpoint version (NULL: the Build named its version). A record
-- whose head moved is answered -4 and writes nothing; the others are recorded as 0011
-- records them (the people fences first, then each record in the order given), in one
-- transaction.
--
-- Each head is read before that record's session lock is taken (or, for a session's
-- later records in a batch, while this transaction holds it): a write committed after the
-- read is not seen, as it would not have been by a head read in a round trip of its own
-- before the record (store/records.py).
CREATE FUNCTION record_model_requests_confirmed(
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
    v_out bigint[] := '{}';
BEGIN
    PERFORM pg_advisory_xact_lock_shared(k) FROM (
        SELECT DISTINCT hashtextextended('erasure' || chr(31) || t || chr(31) || p, 0) AS k
          FROM unnest(p_tenant, p_request) AS r(t, request),
               jsonb_array_elements_text(coalesce(request -> 'people', '[]')) AS p
         ORDER BY k) AS keys;
    FOR i IN 1 .. coalesce(array_length(p_tenant, 1), 0) LOOP
        IF NOT run_head_holds(p_tenant[i], p_session[i], p_run[i], p_head[i], p_latest[i]) THEN
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
