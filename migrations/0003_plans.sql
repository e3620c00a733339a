-- Plans, issue 4: skill bodies loaded per session, runs bound to the snapshot they used,
-- and which persisted snapshots hold whose memories (erasure's index).

-- Skill bodies loaded into a session (row 11), in load order. Sticky: a skill is never
-- deselected, so rows are only ever inserted. At most two per session (core/skills.py).
CREATE TABLE loaded_skills (
    tenant_id   text        NOT NULL,
    session_id  uuid        NOT NULL,
    position    integer     NOT NULL,
    name        text        NOT NULL,
    version     text        NOT NULL,
    trust       smallint    NOT NULL,
    body        text        NOT NULL,
    -- Measured once at load with the plan's model tokenizer; the class cap reads it.
    tokens      bigint      NOT NULL,
    run_id      uuid,
    -- Session sequence of the skill.loaded event.
    sequence    bigint      NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, name),
    UNIQUE (tenant_id, session_id, position),
    FOREIGN KEY (tenant_id, session_id) REFERENCES sessions (tenant_id, session_id)
);

-- context.snapshot.used: a run bound to the nonempty snapshot of one plan epoch, written
-- before the run's first request on that epoch leaves. Erasure reports these runs.
CREATE TABLE snapshot_usages (
    tenant_id        text        NOT NULL,
    session_id       uuid        NOT NULL,
    run_id           uuid        NOT NULL,
    epoch            bigint      NOT NULL,
    snapshot_id      text        NOT NULL,
    recall_trace_id  text        NOT NULL,
    -- Session sequence of the context.snapshot.used event.
    sequence         bigint      NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, run_id, epoch),
    FOREIGN KEY (tenant_id, run_id) REFERENCES runs (tenant_id, run_id),
    FOREIGN KEY (tenant_id, session_id, epoch)
        REFERENCES context_plans (tenant_id, session_id, epoch)
);

CREATE INDEX snapshot_usages_by_plan ON snapshot_usages (tenant_id, session_id, epoch);

-- Which persisted plan snapshots hold a person's memories (MemoryItem.person_ids), written
-- with the plan. Erasure finds every snapshot to redact here instead of scanning plans.
CREATE TABLE snapshot_people (
    tenant_id   text    NOT NULL,
    person_id   text    NOT NULL,
    session_id  uuid    NOT NULL,
    epoch       bigint  NOT NULL,
    PRIMARY KEY (tenant_id, person_id, session_id, epoch),
    FOREIGN KEY (tenant_id, session_id, epoch)
        REFERENCES context_plans (tenant_id, session_id, epoch)
);
