-- Compaction bounds the recorded requests it reads per run in view: each run's latest
-- model.request.started at or below the floor (store/events.py _REQUESTS_FROM). One index
-- probe per run, whichever runs recorded requests since; without it, each probe walked
-- the session's requests back from the floor, filtering by run on the heap.
CREATE INDEX session_events_requests_by_run
    ON session_events (tenant_id, session_id, run_id, sequence)
    WHERE type = 'model.request.started';
