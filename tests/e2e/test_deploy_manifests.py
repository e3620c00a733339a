"""The deployment files agree with the code they deploy (no cluster or Docker needed).

- Every CONTEXT_ENGINE_* variable the Kubernetes manifests and the Compose file set is a
  real setting, and together they pass the service's own configuration validation.
- Every engine container has gRPC liveness (overall status) and readiness (the
  ContextEngine service's status) probes on the port the Dockerfile exposes, resource
  requests and a memory limit, runs as the Dockerfile's non-root user, and is given more
  termination grace than its own shutdown grace.
- The sidecar's worker reaches the engine over localhost; Compose runs migrations before
  the engine, against postgres:15, from the repository's Dockerfile.
- Every engine container listens, with the image's ENV under its own, on every interface
  at the probed port; comments that quote a setting's default quote the real one.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from context_engine._gen.context_engine.v1 import context_engine_pb2 as pb
from context_engine.api.server import _CLOSE_SECONDS
from context_engine.config import Settings, load_settings
from context_engine.telemetry import FLUSH_BUDGET_S

ROOT = Path(__file__).resolve().parents[2]
K8S = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
SERVICE = pb.DESCRIPTOR.services_by_name["ContextEngine"].full_name
PREFIX = "CONTEXT_ENGINE_"


def _dockerfile(keyword: str) -> str:
    lines = (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines()
    return [line.split(None, 1)[1] for line in lines if line.startswith(keyword + " ")][-1]


def _image_env() -> dict[str, str]:
    """The Dockerfile's (runtime stage's) CONTEXT_ENGINE_* ENV settings."""
    words = shlex.split(" ".join(_dockerfile_all("ENV")))
    return {k: v for k, _, v in (w.partition("=") for w in words) if k.startswith(PREFIX)}


def _dockerfile_all(keyword: str) -> list[str]:
    """Every KEYWORD instruction of the last stage, backslash continuations joined."""
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    stage = text.rpartition("\nFROM ")[2]
    return [line.split(None, 1)[1] for line in stage.splitlines() if line.startswith(keyword + " ")]


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _engine_containers() -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(file, pod spec, container) for every container running the engine image."""
    found = []
    for path in K8S:
        for doc in _docs(path):
            spec = doc.get("spec", {})
            pod = spec.get("template", {}).get("spec", {})
            for container in pod.get("initContainers", []) + pod.get("containers", []):
                if "context-engine:" in container.get("image", ""):
                    found.append((path, pod, container))
    return found


def _env(container: dict[str, Any]) -> dict[str, str]:
    out = {}
    for var in container.get("env", []):
        # A value from a Secret: something valid of the right shape.
        out[var["name"]] = var.get("value", "postgresql://u:p@db:5432/ctx")
    return out


def _secret_files(path: Path) -> dict[str, str]:
    """File name -> content of every Secret's stringData in a manifest (mounted files)."""
    return {
        name: content
        for doc in _docs(path)
        if doc["kind"] == "Secret"
        for name, content in doc.get("stringData", {}).items()
    }


def _validate(env: dict[str, str], tmp_path: Path, files: dict[str, str]) -> Settings:
    """The service's own validation; file settings read the Secret they are mounted from."""
    values = {k: v for k, v in env.items() if k.startswith(PREFIX)}
    unknown = [k for k in values if k[len(PREFIX) :].lower() not in Settings.model_fields]
    assert not unknown, f"not settings: {unknown}"
    for key, value in values.items():
        if key.endswith("_FILE"):
            name = Path(value).name
            assert name in files, f"{key}={value} is mounted from no Secret in the manifest"
            (tmp_path / name).write_text(files[name], encoding="utf-8")
            values[key] = str(tmp_path / name)
    return load_settings(environ=values)


# deploy/measure.py: a server's RSS at idle, before any call (docs/scaling.md, Sizing),
# rounded up; and room for a few maximum-size calls in flight (each request several times
# over while it is parsed, rendered and written).
IDLE_BYTES = 192 * 2**20
IN_FLIGHT_BYTES = 64 * 2**20
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity in bytes (the binary suffixes the manifests use)."""
    unit = quantity[-2:]
    return int(quantity[:-2]) * _UNITS[unit] if unit in _UNITS else int(quantity)


def test_manifests_exist() -> None:
    names = {p.name for p in K8S}
    assert {"sidecar.yaml", "standalone.yaml", "migrate-job.yaml"} <= names
    kinds = {d["kind"] for p in K8S for d in _docs(p)}
    assert {"Deployment", "Service", "Job"} <= kinds


@pytest.mark.parametrize("index", range(len(_engine_containers())))
def test_engine_container(index: int, tmp_path: Path) -> None:
    path, pod, container = _engine_containers()[index]
    env = _env(container)
    where = f"{path.name}:{container['name']}"
    settings = _validate(env, tmp_path, _secret_files(path))
    user = int(_dockerfile("USER").split(":")[0])
    assert container["securityContext"]["runAsUser"] == user, where
    assert pod["securityContext"]["runAsNonRoot"] is True, where
    requests = container["resources"]["requests"]
    assert requests["cpu"] and requests["memory"], where
    limit = _bytes(container["resources"]["limits"]["memory"])
    if container.get("command"):  # the migration Job
        assert container["command"] == ["context-engine", "migrate"], where
        return
    # docs/operations.md, Memory: a replica holds about what it keeps plus its memos plus
    # the calls in flight, over what it holds idle (the tiktoken rank tables among it).
    kept = settings.replica_cache_bytes + settings.render_memo_bytes
    assert limit >= IDLE_BYTES + kept + IN_FLIGHT_BYTES, where
    port = int(_dockerfile("EXPOSE"))
    assert {"name": "grpc", "containerPort": port} in container["ports"], where
    # Kubelet probes come from the node, so even the sidecar listens beyond loopback; so
    # every call is authenticated: under auth "none" the tenant is the request's, and a
    # network plugin that does not enforce NetworkPolicy left every tenant open to any Pod
    # (an audit).
    listen = _validate({**_image_env(), **env}, tmp_path, _secret_files(path)).listen
    assert listen == f"0.0.0.0:{port}", where
    assert settings.auth != "none", f"{where} listens beyond loopback"
    assert container["livenessProbe"].get("timeoutSeconds", 1) >= 3, where
    assert container["livenessProbe"]["grpc"] == {"port": port}, where
    assert container["readinessProbe"]["grpc"] == {"port": port, "service": SERVICE}, where
    assert container["startupProbe"]["grpc"]["port"] == port, where
    # The kill timeout covers the grace and, with a collector set, the flush after it:
    # at most FLUSH_BUDGET_S. A native sidecar (restartPolicy Always) is sent SIGTERM only
    # once the worker has exited, so its Pod's timeout leaves the worker 30 s of its own
    # drain before that.
    # Then the two pools close, each bounded (api/server.py _CLOSE_SECONDS).
    flush = FLUSH_BUDGET_S if "OTEL_EXPORTER_OTLP_ENDPOINT" in env else 0
    worker = 30 if container.get("restartPolicy") == "Always" else 0
    needed = worker + settings.shutdown_grace_seconds + flush + 2 * _CLOSE_SECONDS
    assert pod["terminationGracePeriodSeconds"] > needed, where
    assert settings.migrate_on_start is False, f"{where}: migrate-job.yaml migrates"
    if settings.metrics_listen:
        metrics = int(settings.metrics_listen.rpartition(":")[2])
        assert {"name": "metrics", "containerPort": metrics} in container["ports"], where


def test_comments_quote_the_real_max_request_bytes_default() -> None:
    """The sizing comments reason from max_request_bytes' default; they said 16 MiB while
    config.py says 4 MiB."""
    default_mib = Settings().max_request_bytes // (1024 * 1024)
    quoted = []
    for path in [*K8S, COMPOSE]:
        text = " ".join(path.read_text(encoding="utf-8").replace("#", " ").split())
        quoted += re.findall(r"max_request_bytes[^.]*?(\d+) MiB by default", text)
    assert quoted, "the sizing comments name the default"
    assert set(quoted) == {str(default_mib)}


def test_sidecar_worker_talks_over_localhost_with_a_token_the_engine_takes() -> None:
    docs = _docs(ROOT / "deploy/k8s/sidecar.yaml")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (engine,) = pod["initContainers"]
    assert engine["restartPolicy"] == "Always", "a native sidecar"
    (worker,) = pod["containers"]
    target = _env(worker)["CONTEXT_ENGINE_TARGET"]
    assert target == f"127.0.0.1:{_dockerfile('EXPOSE')}"
    # The worker's token, from the Secret whose token map the engine mounts, names the
    # worker's tenant.
    (token_var,) = [v for v in worker["env"] if v["name"] == "CONTEXT_ENGINE_TOKEN"]
    ref = token_var["valueFrom"]["secretKeyRef"]
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"]]
    mounted = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert ref["name"] in mounted.values()
    tokens = json.loads(secret["stringData"]["tokens.json"])
    assert tokens[secret["stringData"][ref["key"]]] == _env(worker)["CONTEXT_ENGINE_TENANT"]


def test_an_autoscaled_deployment_leaves_its_count_to_the_autoscaler() -> None:
    """A Deployment's `replicas` beside an HPA reset the count on every apply (an audit:
    12 replicas under load went back to 3), and a PodDisruptionBudget's fixed
    minAvailable let a drain take all but that many of an autoscaled fleet at once."""
    for path in K8S:
        docs = _docs(path)
        scaled = {
            d["spec"]["scaleTargetRef"]["name"]
            for d in docs
            if d["kind"] == "HorizontalPodAutoscaler"
        }
        for d in docs:
            if d["kind"] == "Deployment" and d["metadata"]["name"] in scaled:
                assert "replicas" not in d["spec"], path.name
            if d["kind"] == "PodDisruptionBudget" and scaled:
                assert d["spec"].get("maxUnavailable") == 1, path.name
        assert not scaled or any(d["kind"] == "PodDisruptionBudget" for d in docs), path.name


def test_standalone_service_routes_to_the_grpc_port() -> None:
    docs = _docs(ROOT / "deploy/k8s/standalone.yaml")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert services
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == "grpc" and port["appProtocol"] == "grpc"


def test_compose(tmp_path: Path) -> None:
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    services = compose["services"]
    assert services["postgres"]["image"] == "postgres:15"
    migrate, engine = services["migrate"], services["context-engine"]
    assert (COMPOSE.parent / migrate["build"]["context"] / migrate["build"]["dockerfile"]).is_file()
    assert migrate["entrypoint"] == ["context-engine", "migrate"]
    assert engine["image"] == migrate["image"]
    assert engine["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for service in (migrate, engine):
        _validate(service["environment"], tmp_path, {})
    port = _dockerfile("EXPOSE")
    assert f"127.0.0.1:{port}:{port}" in engine["ports"]
    # The DSN names the database the postgres service creates.
    dsn = engine["environment"]["CONTEXT_ENGINE_DATABASE_URL"]
    pg = services["postgres"]["environment"]
    assert re.fullmatch(
        rf"postgresql://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/"
        rf"{pg['POSTGRES_DB']}",
        dsn,
    )
