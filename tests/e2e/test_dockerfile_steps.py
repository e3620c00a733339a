"""Keeps the Dockerfile honest without a Docker engine.

The Dockerfile is parsed into stages and instructions. The static checks hold its shape
(multi-stage, slim Python 3.11 runtime, non-root user, gRPC health check, port, entry
point, a build context .dockerignore does not cut short). Then its install steps run for
real, in a temporary directory standing in for the image:

- the build context is assembled from the builder stage's COPY sources (symlinks kept);
- each RUN step that uses pip or python is executed with the image's paths (/wheels,
  /opt/venv) mapped into the temporary directory: the project wheel is built, a fresh venv
  is made, the wheel is installed into it;
- the installed package must carry every migration and data file of the source tree, and
  `context-engine --help`, `context-engine migrate` (on a fresh database), the ENTRYPOINT
  (with the image's ENV, CONTEXT_ENGINE_LISTEN moved to a free loopback port as
  `docker run -e` would) and the HEALTHCHECK command (following that variable) must work
  from that venv.

The ENTRYPOINT also runs (cheaply, `serve` stubbed or failing early) to show it honours
CONTEXT_ENGINE_LISTEN and that without DATABASE_URL it stops with one line, exit 2.

Offline adjustments, each marked where it is made: the wheel builds with
--no-build-isolation (setuptools from the test venv instead of PyPI); dependency wheels are
not built (that step needs PyPI) and the fresh venv reaches the dependencies through a .pth
file naming a directory that links the test venv's files of the runtime dependency closure
only (pyproject's dependencies without extras, transitively), so a runtime import of a
dev-only package fails here as in the image, and `context_engine` itself is imported only
from the installed wheel (asserted).
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import asyncpg
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
TIMEOUT_S = 600  # bounds a hung pip or server; not a performance assertion


@dataclass
class Stage:
    name: str
    image: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _logical_lines(text: str) -> Iterator[str]:
    """Instructions with backslash continuations joined; comments and blanks dropped."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield pending + line
        pending = ""


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            parts = re.split(r"\s+AS\s+", rest, flags=re.I)
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            stages.append(Stage(parts[1] if len(parts) > 1 else str(len(stages)), image))
        else:
            stages[-1].instructions.append((keyword, rest))
    return args, stages


@pytest.fixture(scope="module")
def dockerfile() -> list[Stage]:
    _, stages = parse(DOCKERFILE.read_text(encoding="utf-8"))
    return stages


def _image_env(stage: Stage) -> dict[str, str]:
    """The stage's ENV settings (KEY=VALUE form; no variable expansion)."""
    return dict(word.partition("=")[::2] for env in stage.all("ENV") for word in shlex.split(env))


def _dockerignore_allows(path: str) -> bool:
    """Last matching rule wins, as in Docker; enough of the syntax for our own file."""
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        if pattern == "*" or path == pattern or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


def test_dockerfile_shape(dockerfile: list[Stage]) -> None:
    assert len(dockerfile) >= 2, "multi-stage: a builder and a runtime"
    builder, runtime = dockerfile[0], dockerfile[-1]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", runtime.image), runtime.image
    assert builder.image == runtime.image

    users = runtime.all("USER")
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "runs as non-root"
    assert runtime.all("EXPOSE") == ["50051"]
    # Settings come from the environment only: a flag in the entry point would override
    # CONTEXT_ENGINE_LISTEN (flags beat variables), so the listen default is an ENV.
    assert json.loads(runtime.all("ENTRYPOINT")[-1]) == ["context-engine", "serve"]
    assert _image_env(runtime)["CONTEXT_ENGINE_LISTEN"] == "0.0.0.0:50051"
    (health,) = runtime.all("HEALTHCHECK")
    command = json.loads(health.split("CMD", 1)[1])
    script = command[1]
    assert command[2:] == [], "no target: the probe follows CONTEXT_ENGINE_LISTEN"
    copied = {dest: src for src, dest in (c.split() for c in runtime.all("COPY"))}
    assert copied[script] == "deploy/healthcheck.py" and (ROOT / copied[script]).is_file()

    # The runtime installs only what the builder built: no index, no compilers.
    installs = [r for r in runtime.all("RUN") if "pip install" in r]
    assert installs and all("--no-index" in r and "from=builder" in r for r in installs)
    # Everything the stages COPY from the context is inside the build context.
    for stage in dockerfile:
        for copy in stage.all("COPY"):
            if copy.startswith("--from"):
                continue
            *sources, _ = copy.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert _dockerignore_allows(source.rstrip("/")), f".dockerignore drops {source}"


def _container_env(**extra: str) -> dict[str, str]:
    """This process's environment without Python paths or engine settings, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "DATABASE_URL"}
        and not k.startswith("CONTEXT_ENGINE_")
    }
    return {**env, **extra}


async def _run(
    *argv: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=_container_env() if env is None else env,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"{argv} did not finish within {TIMEOUT_S}s") from None
    return int(process.returncode or 0), out.decode("utf-8", "replace")


def _equivalent(run: str, paths: dict[str, Path], cwd: Path) -> list[str] | None:
    """A RUN step as argv on this machine, or None for one that needs the image's OS or
    PyPI (checked statically instead)."""
    words = shlex.split(re.sub(r"--mount=\S+", "", run))
    mapped = []
    for word in words:
        for container, local in paths.items():
            word = word.replace(container, str(local))
        expanded = sorted(glob.glob(word, root_dir=cwd)) if "*" in word else [word]
        assert expanded, f"{word} matches nothing"
        mapped += expanded
    program, rest = mapped[0], mapped[1:]
    if program == "pip":  # the builder image's pip: the test venv's pip, offline
        if rest[:1] != ["wheel"] or "--no-deps" not in rest:
            return None  # the dependency wheels step needs PyPI
        return [sys.executable, "-m", "pip", *rest, "--no-build-isolation"]  # offline
    if program == "python":  # the runtime image's interpreter
        return [sys._base_executable, *rest]  # type: ignore[attr-defined]
    if program.endswith("/bin/pip"):
        assert "--no-index" in rest
        return [program, *rest, "--no-deps"]  # dependencies come through the .pth below
    return None


async def test_dockerfile_install_steps_work(dockerfile: list[Stage], tmp_path: Path) -> None:
    builder, runtime = dockerfile[0], dockerfile[-1]
    context = tmp_path / "src"
    paths = {"/wheels": tmp_path / "wheels", "/opt/venv": tmp_path / "venv", "/src": context}
    context.mkdir()
    for copy in builder.all("COPY"):
        *sources, dest = copy.split()
        for source in sources:
            target = context / dest if dest not in {"./", "."} else context / source
            if (ROOT / source).is_dir():
                shutil.copytree(
                    ROOT / source,
                    target,
                    symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
                )
            else:
                shutil.copy2(ROOT / source, context / Path(source).name)

    executed = 0
    for stage in (builder, runtime):
        for keyword, run in stage.instructions:
            if keyword == "COPY" and stage is runtime:  # into the image: into the stand-in
                source, dest = run.split()
                for container, local in paths.items():
                    dest = dest.replace(container, str(local))
                shutil.copy2(ROOT / source, dest)
            argv = _equivalent(run, paths, context) if keyword == "RUN" else None
            if argv is None:
                continue
            code, out = await _run(*argv, cwd=context)
            assert code == 0, f"RUN {run}\n-> {argv}\n{out}"
            executed += 1
    assert executed == 3, "wheel build, venv, wheel install"
    # Dependencies (offline): the runtime dependency closure's files from the test venv,
    # linked into a directory of their own, after the venv's own site-packages and added
    # only now so that pip above saw an empty venv. Only the closure: with the whole test
    # venv reachable, an import of a dev-only package (yaml, say) passed here and would
    # fail in the image (an audit).
    deps = tmp_path / "runtime-deps"
    _link_runtime_dependencies(deps)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(paths["/opt/venv"])}))
    (site / "_runtime_deps.pth").write_text(f"{deps}\n", encoding="utf-8")

    venv = paths["/opt/venv"] / "bin"
    code, out = await _run(
        str(venv / "python"),
        "-c",
        "import context_engine, pathlib; print(pathlib.Path(context_engine.__file__).parent)",
    )
    assert code == 0, out
    package = Path(out.strip().splitlines()[-1])
    assert package.is_relative_to(paths["/opt/venv"]), f"imported {package}, not the wheel"

    installed_sql = sorted(p.name for p in (package / "_migrations").glob("*.sql"))
    assert installed_sql == sorted(p.name for p in (ROOT / "migrations").glob("*.sql"))
    assert not (package / "_migrations").is_symlink()
    source_data = ROOT / "service" / "context_engine" / "data"
    wanted = sorted(
        str(p.relative_to(source_data))
        for p in source_data.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    have = sorted(
        str(p.relative_to(package / "data"))
        for p in (package / "data").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert have == wanted, "package-data must ship every data file"
    assert (package / "py.typed").is_file()

    code, out = await _run(str(venv / "context-engine"), "--help")
    assert code == 0 and "serve" in out and "migrate" in out, out

    name = f"ce_docker_{uuid.uuid4().hex[:12]}"
    base = os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    dsn = f"{base.rpartition('/')[0]}/{name}"
    admin = await asyncpg.connect(base)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        code, out = await _run(str(venv / "context-engine"), "migrate", "--database-url", dsn)
        assert code == 0, out
        conn = await asyncpg.connect(dsn)
        try:
            versions = [r[0] for r in await conn.fetch("SELECT version FROM schema_migrations")]
        finally:
            await conn.close()
        assert sorted(versions) == [Path(n).stem for n in installed_sql]
        await _serve_and_probe(runtime, venv, paths, dsn)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def _runtime_closure(root: str = "context-engine") -> list[metadata.Distribution]:
    """The distributions `root` requires, without extras, and theirs, transitively."""
    seen: dict[str, metadata.Distribution] = {}
    pending = [root]
    while pending:
        name = canonicalize_name(pending.pop())
        if name in seen:
            continue
        seen[name] = dist = metadata.distribution(name)
        for line in dist.requires or ():
            wanted = Requirement(line)
            if wanted.marker is None or wanted.marker.evaluate({"extra": ""}):
                pending.append(wanted.name)
    return [d for name, d in seen.items() if name != canonicalize_name(root)]


def _link_runtime_dependencies(target: Path) -> None:
    """Every installed file of the runtime closure (modules and dist-info), linked into
    `target` at its path below site-packages; nothing of any other distribution."""
    for dist in _runtime_closure():
        for file in dist.files or ():
            if file.parts[0] == "..":  # a console script, outside site-packages
                continue
            link = target / file
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(Path(str(dist.locate_file(file))).resolve())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _serve_and_probe(runtime: Stage, venv: Path, paths: dict[str, Path], dsn: str) -> None:
    """The ENTRYPOINT as `docker run -e CONTEXT_ENGINE_LISTEN=127.0.0.1:PORT -e
    DATABASE_URL=...` would start it, probed by the HEALTHCHECK command, which is given no
    target and must find the server through the same variable."""
    entry = json.loads(runtime.all("ENTRYPOINT")[-1])
    listen = f"127.0.0.1:{_free_port()}"
    env = _container_env(
        **{k: v for k, v in _image_env(runtime).items() if k.startswith("CONTEXT_ENGINE_")},
    )
    env.update(CONTEXT_ENGINE_LISTEN=listen, DATABASE_URL=dsn)
    server = await asyncio.create_subprocess_exec(
        str(venv / entry[0]),
        *entry[1:],
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert server.stdout is not None
        seen: list[str] = []
        while not any("listening on" in line for line in seen):
            line = (await asyncio.wait_for(server.stdout.readline(), TIMEOUT_S)).decode()
            assert line, "the server exited before listening:\n" + "".join(seen)
            seen.append(line)
        assert f"listening on {listen}" in seen[-1], seen[-1]
        (health,) = runtime.all("HEALTHCHECK")
        probe = json.loads(health.split("CMD", 1)[1])
        probe = [
            str(venv / "python")
            if word == "python"
            else word.replace("/opt/venv", str(paths["/opt/venv"]))
            for word in probe
        ]
        code, out = await _run(*probe, env=env)
        assert code == 0 and "SERVING" in out, out
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), TIMEOUT_S)


def _entrypoint_cli(
    argv: list[str], prelude: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The entry point's `context-engine ARGS` through cli.main, after `prelude` (stubs)."""
    script = (
        f"import sys\n{prelude}\nfrom context_engine.cli import main\nsys.exit(main({argv!r}))\n"
    )
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )


def test_the_image_honours_context_engine_listen(dockerfile: list[Stage]) -> None:
    """Every setting is an environment variable, so a sidecar operator who sets
    CONTEXT_ENGINE_LISTEN=127.0.0.1:50051 (the engine off the pod network) must get that
    address, not one baked into the ENTRYPOINT; without it, the image's 0.0.0.0:50051."""
    runtime = dockerfile[-1]
    entry = json.loads(runtime.all("ENTRYPOINT")[-1])
    assert entry[0] == "context-engine"
    prelude = (
        "import context_engine.api.server as server\n"
        "async def fake(settings):\n"
        "    print('LISTEN=' + settings.listen)\n"
        "server.serve = fake\n"
        "sys.modules['uvloop'] = None\n"
    )
    image = _image_env(runtime)
    for listen, expected in (("127.0.0.1:50051", "127.0.0.1:50051"), (None, "0.0.0.0:50051")):
        env = _container_env(**image, DATABASE_URL="postgresql://db/x")
        if listen is not None:
            env["CONTEXT_ENGINE_LISTEN"] = listen
        done = _entrypoint_cli(entry[1:], prelude, env)
        assert done.returncode == 0, done.stderr
        assert f"LISTEN={expected}" in done.stdout, done.stdout


def test_the_image_without_a_database_url_exits_2_with_one_clear_line(
    dockerfile: list[Stage], tmp_path: Path
) -> None:
    """The image installs the engine without the [embedded] extra, so `docker run` without
    DATABASE_URL has no database: a missing setting, the documented one-line exit 2 (it
    was a RuntimeError traceback from embedded_db)."""
    runtime = dockerfile[-1]
    entry = json.loads(runtime.all("ENTRYPOINT")[-1])
    argv = [*entry[1:], "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "pgdata")]
    done = _entrypoint_cli(argv, "sys.modules['pgserver'] = None", _container_env())
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("context-engine: no database configured"), line
    assert "DATABASE_URL" in line and "context-engine[embedded]" in line


def test_the_healthcheck_of_a_tls_listener_without_a_ca_says_what_is_missing() -> None:
    """The image's HEALTHCHECK probes in plaintext; on a TLS listener that failed as
    UNAVAILABLE, read as the engine being down (an audit). Run without --tls-ca while
    CONTEXT_ENGINE_TLS_CERT_FILE is set, it fails naming the flag, before any call."""
    env = {**os.environ, "CONTEXT_ENGINE_TLS_CERT_FILE": "/etc/tls/server.crt"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "healthcheck.py"), "127.0.0.1:1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "uses TLS" in done.stderr and "--tls-ca" in done.stderr, done.stderr
