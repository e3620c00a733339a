-- Budgets, issue 3: estimator reconciliation against reported usage.

-- The correction factor is per tenant and model: one tenant's reports (or bogus ones)
-- never move another tenant's budgets. `tokenizer` is what the factor was learned for: a
-- registry change of the model's tokenizer resets it. `observed_ppm` is the smoothed
-- actual/estimate ratio, visible in both directions; `factor_ppm` (never below 1.0) is what
-- estimates are multiplied by.
ALTER TABLE estimator_corrections ADD COLUMN tenant_id text NOT NULL DEFAULT '';
ALTER TABLE estimator_corrections ADD COLUMN tokenizer text NOT NULL DEFAULT '';
ALTER TABLE estimator_corrections ADD COLUMN observed_ppm bigint NOT NULL DEFAULT 1000000;
ALTER TABLE estimator_corrections DROP CONSTRAINT estimator_corrections_pkey;
ALTER TABLE estimator_corrections ADD PRIMARY KEY (tenant_id, model_id);

-- One row per usage report: a request's usage is counted once per idempotency key; a
-- retry with the same key returns the stored response and changes nothing.
CREATE TABLE usage_reports (
    tenant_id                    text        NOT NULL,
    session_id                   uuid        NOT NULL,
    -- Session sequence of the model.request.started event the usage is for.
    request_sequence             bigint      NOT NULL,
    idempotency_key              text        NOT NULL,
    -- SHA-256 of the report as sent: the same key with another report is an error.
    request_sha256               text        NOT NULL,
    model_id                     text        NOT NULL,
    -- The estimate recorded on model.request.started (prefix exact + body estimated).
    estimated_input_tokens       bigint      NOT NULL,
    -- input + cache read + cache creation: everything the provider read.
    actual_input_tokens          bigint      NOT NULL,
    input_tokens                 bigint      NOT NULL,
    cache_read_input_tokens      bigint      NOT NULL,
    cache_creation_input_tokens  bigint      NOT NULL,
    output_tokens                bigint      NOT NULL,
    signed_error_ppm             bigint      NOT NULL,
    cached_prefix_ppm            bigint      NOT NULL,
    -- Whether the report moved the factor (false: another model answered than was planned).
    absorbed                     boolean     NOT NULL,
    response                     jsonb       NOT NULL,
    created_at                   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, session_id, request_sequence, idempotency_key),
    FOREIGN KEY (tenant_id, session_id) REFERENCES sessions (tenant_id, session_id)
);

CREATE INDEX usage_reports_by_model ON usage_reports (tenant_id, model_id, created_at);
