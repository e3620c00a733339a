-- What erasing a person has done so far, kept with the record of the erasure: the sessions
-- whose current plan it invalidated, the runs bound to the snapshots it redacted, and its
-- counts. EraseSubject answers with it, cumulatively, so a resend whose first answer was
-- lost (or a later erasure of the same person, which finds nothing new: the person is
-- fenced) answers as the first did instead of empty, and the bound runs a compliance
-- follow-up needs are not lost with a dropped response. NULL for erasures made before.
ALTER TABLE erased_people ADD COLUMN outcome jsonb;
