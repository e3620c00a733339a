-- What a run carries, recorded as the log is written, so a replica's first Build of a
-- session reads only the log's newest events instead of the whole log (core/log_tail.py,
-- api/log_tail.py). Two columns on each conversation event of a top-level run (in_history):
--
-- `answers`: on a tool result, the sequence of the call it answers: the previous
-- conversation event of its (run, call id) when that event is a call, else NULL. This is
-- exactly the pairing of core/seeding.py (Rule 3): a result is carried iff the call it
-- answers lies above the summary floor, and a call iff a result below the run's seed
-- answers it. So the newest events alone say which of them are carried.
--
-- `carried_through`: the running count, in log order, of the session's conversation events
-- up to and including this one, a message counting 1, a result that answers a call 2 (its
-- call with it) and anything else 0. So how many items the events older than those read
-- carry is a difference of two of these (less the pairs that straddle a summary floor or
-- the read's first event, which the reader counts), not a count over the log.
--
-- A trigger fills both, so every writer (a replica of the previous version during a
-- rolling update included) writes them; events are appended under the session lock, in
-- sequence order (store/events.py, one INSERT ordered by sequence, whose earlier rows a
-- row trigger sees). Existing events are filled below, by the same rule.

ALTER TABLE session_events ADD COLUMN answers bigint;
ALTER TABLE session_events ADD COLUMN carried_through bigint;

-- The call a result answers: the latest earlier tool event of its (run, call id).
CREATE INDEX session_events_tool_keys
    ON session_events (tenant_id, session_id, run_id, (payload ->> 'call_id'), sequence)
    WHERE in_history AND payload ->> 'kind' IN ('tool_call', 'tool_result');

-- The results above a summary floor whose call lies at or below it (read only for a run
-- with a summary: a new run's floor is 0).
CREATE INDEX session_events_answers
    ON session_events (tenant_id, session_id, sequence, answers)
    WHERE answers IS NOT NULL;

UPDATE session_events e SET answers = p.previous
  FROM (SELECT tenant_id, session_id, sequence, payload ->> 'kind' AS kind,
               lag(payload ->> 'kind') OVER w AS previous_kind,
               lag(sequence) OVER w AS previous
          FROM session_events
         WHERE in_history AND payload ->> 'kind' IN ('tool_call', 'tool_result')
        WINDOW w AS (PARTITION BY tenant_id, session_id, run_id, payload ->> 'call_id'
                     ORDER BY sequence)) p
 WHERE e.tenant_id = p.tenant_id AND e.session_id = p.session_id AND e.sequence = p.sequence
   AND p.kind = 'tool_result' AND p.previous_kind = 'tool_call';

CREATE FUNCTION carried_weight(p_kind text, p_answers bigint) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN p_kind IN ('user_message', 'assistant_message') THEN 1
        WHEN p_kind = 'tool_result' AND p_answers IS NOT NULL THEN 2
        ELSE 0
    END
$$;

UPDATE session_events e SET carried_through = w.total
  FROM (SELECT tenant_id, session_id, sequence,
               sum(carried_weight(payload ->> 'kind', answers))
                   OVER (PARTITION BY tenant_id, session_id ORDER BY sequence) AS total
          FROM session_events WHERE in_history) w
 WHERE e.tenant_id = w.tenant_id AND e.session_id = w.session_id AND e.sequence = w.sequence;

CREATE FUNCTION session_events_carried() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_kind     text;
    v_sequence bigint;
BEGIN
    IF NEW.payload ->> 'kind' = 'tool_result' THEN
        SELECT payload ->> 'kind', sequence INTO v_kind, v_sequence FROM session_events
         WHERE tenant_id = NEW.tenant_id AND session_id = NEW.session_id AND in_history
           AND run_id = NEW.run_id AND payload ->> 'call_id' = NEW.payload ->> 'call_id'
           AND payload ->> 'kind' IN ('tool_call', 'tool_result') AND sequence < NEW.sequence
         ORDER BY sequence DESC LIMIT 1;
        NEW.answers := CASE WHEN v_kind = 'tool_call' THEN v_sequence END;
    ELSE
        NEW.answers := NULL;
    END IF;
    NEW.carried_through := carried_weight(NEW.payload ->> 'kind', NEW.answers) + coalesce(
        (SELECT carried_through FROM session_events
          WHERE tenant_id = NEW.tenant_id AND session_id = NEW.session_id AND in_history
            AND sequence < NEW.sequence
          ORDER BY sequence DESC LIMIT 1), 0);
    RETURN NEW;
END
$$;

CREATE TRIGGER session_events_carried BEFORE INSERT ON session_events
    FOR EACH ROW WHEN (NEW.in_history) EXECUTE FUNCTION session_events_carried();

-- A conversation event names its run (the engine always wrote one), so the trigger's
-- lookup is an index probe; NOT VALID: checked for new rows, existing ones left as they are
-- (the fill above pairs any without a run as core/seeding.py does, under the run "").
ALTER TABLE session_events ADD CONSTRAINT session_events_history_run
    CHECK (NOT in_history OR run_id IS NOT NULL) NOT VALID;
-- Every conversation event is counted (the fill above, then the trigger): the reader
-- relies on it.
ALTER TABLE session_events ADD CONSTRAINT session_events_history_counted
    CHECK (NOT in_history OR carried_through IS NOT NULL);
