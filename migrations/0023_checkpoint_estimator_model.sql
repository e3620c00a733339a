-- The model a checkpoint's pinned estimator factor is the correction for. A Build of the
-- checkpoint on another model's plan (a run continued after a MODEL_CHANGED rotation)
-- applies no factor: the spec resets the factor when the model changes, and the old
-- model's (4x, say) refused every Build of the run BUDGET_EXCEEDED (an audit). A column of
-- its own, not a field of the checkpoint's body: the previous version reads bodies with
-- unknown fields refused, and keeps working beside this one (its checkpoints have NULL
-- here, and apply their factor as before). Nullable without a default: no table rewrite.
ALTER TABLE run_checkpoints ADD COLUMN estimator_model_id text;
