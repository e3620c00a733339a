-- The context engine's storage. Every table is keyed by tenant first: every query is
-- tenant-scoped, and a foreign id is indistinguishable from a missing one.

CREATE TABLE sessions (
    tenant_id      text        NOT NULL,
    session_id     uuid        NOT NULL,
    -- Allocator of the session's event sequence; the row lock serializes a session's writes.
    last_sequence  bigint      NOT NULL DEFAULT 0,
    -- The current plan epoch (0 until the first plan).
    current_epoch  bigint      NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id)
);

-- The append-only session event log: the system of record.
CREATE TABLE session_events (
    tenant_id   text        NOT NULL,
    session_id  uuid        NOT NULL,
    sequence    bigint      NOT NULL,
    type        text        NOT NULL,
    run_id      uuid,
    item_id     text,
    -- True for conversation items of top-level runs: what later runs carry as history.
    -- A child run's items stay in the log but are not the session's conversation.
    in_history  boolean     NOT NULL DEFAULT false,
    payload     jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, sequence),
    FOREIGN KEY (tenant_id, session_id) REFERENCES sessions (tenant_id, session_id)
);

-- Seeding reads the conversation strictly below a pinned sequence.
CREATE INDEX session_events_history
    ON session_events (tenant_id, session_id, sequence)
    WHERE in_history;

CREATE INDEX session_events_by_type
    ON session_events (tenant_id, session_id, type, sequence);

-- Retried writes return their first result; a key reused for another request is an error.
CREATE TABLE idempotency_keys (
    tenant_id       text        NOT NULL,
    session_id      uuid        NOT NULL,
    key             text        NOT NULL,
    operation       text        NOT NULL,
    request_sha256  text        NOT NULL,
    response        jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, key),
    FOREIGN KEY (tenant_id, session_id) REFERENCES sessions (tenant_id, session_id)
);

CREATE TABLE runs (
    tenant_id            text        NOT NULL,
    session_id           uuid        NOT NULL,
    run_id               uuid        NOT NULL,
    parent_run_id        uuid,
    -- Session sequence of the seeding user.message.created event, written in the same
    -- transaction that appends it. NULL for a child run: it seeds from its parent's
    -- instruction over an empty history.
    seed_event_sequence  bigint,
    epoch                bigint      NOT NULL,
    created_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, run_id),
    FOREIGN KEY (tenant_id, session_id) REFERENCES sessions (tenant_id, session_id)
);

CREATE INDEX runs_by_session ON runs (tenant_id, session_id, created_at);

-- A run's working state, versioned for optimistic concurrency.
CREATE TABLE run_checkpoints (
    tenant_id             text        NOT NULL,
    run_id                uuid        NOT NULL,
    version               bigint      NOT NULL,
    body                  jsonb       NOT NULL,
    -- The estimator correction the checkpoint was written with (parts per million).
    estimator_factor_ppm  bigint      NOT NULL DEFAULT 1000000,
    created_at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, run_id, version),
    FOREIGN KEY (tenant_id, run_id) REFERENCES runs (tenant_id, run_id)
);

-- Immutable plans, one per (session, epoch): two replicas cannot both rotate.
CREATE TABLE context_plans (
    tenant_id      text        NOT NULL,
    session_id     uuid        NOT NULL,
    epoch          bigint      NOT NULL,
    reason         text        NOT NULL,
    prefix_sha256  text        NOT NULL,
    plan           jsonb       NOT NULL,
    spec           jsonb       NOT NULL,
    -- Keys the envelope nonces; never rendered, never returned by the API.
    secret         bytea       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, epoch),
    FOREIGN KEY (tenant_id, session_id) REFERENCES sessions (tenant_id, session_id)
);

-- Per-model estimator correction, reconciled from reported usage.
CREATE TABLE estimator_corrections (
    model_id    text        PRIMARY KEY,
    factor_ppm  bigint      NOT NULL,
    samples     bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
