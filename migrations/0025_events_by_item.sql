-- A fact's evidence named by item id (UpdateWorkingState's `source_item_ids`, the ids the
-- model reads in its envelopes): store/working_state.py `resolve_item_ids` finds, per id,
-- the run's own item or the newest of the conversation below its seed. Without this, each
-- lookup read every event of the session under its lock.
CREATE INDEX session_events_by_item
    ON session_events (tenant_id, session_id, item_id, sequence)
    WHERE item_id IS NOT NULL;
