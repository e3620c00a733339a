-- Whom EraseSubject has erased, per tenant, as the SHA-256 of the person id (the record of
-- an erasure does not keep the id it erased). A snapshot that still names an erased person
-- came from a recall that predates the erasure (or ignored it): Plan and Rotate refuse it
-- (PERSON_ERASED) instead of persisting the memories again. Written under the person's
-- fence, an advisory lock that plan persistence holds shared (store/snapshots.py), so an
-- erasure either finds a snapshot persisted concurrently or the snapshot is refused.
CREATE TABLE erased_people (
    tenant_id      text        NOT NULL,
    person_sha256  text        NOT NULL,
    erased_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, person_sha256)
);
