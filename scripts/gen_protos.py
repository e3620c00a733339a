"""Generate the committed gRPC stubs from proto/ into service/context_engine/_gen.

protoc writes imports as `from context_engine.v1 import ...`, which would collide with our
own top-level `context_engine` package, so the imports are rewritten to the private
`context_engine._gen` package. `--check` regenerates into a temporary directory and exits 1
when the committed stubs differ (CI runs it).

The same stubs are generated into the Python client package (imports rewritten to
`context_engine_client._gen`), and the .proto sources are copied into the TypeScript client,
which loads them at run time; `--check` covers every copy.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from google.rpc import status_pb2
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
TARGET = ROOT / "service" / "context_engine" / "_gen"
IMPORT_RE = re.compile(r"^from context_engine\.v1 import", re.MULTILINE)
# Every generated Python copy: (directory, the package its imports are rewritten to).
PY_TARGETS = (
    (TARGET, "context_engine._gen"),
    (
        ROOT / "clients" / "python" / "src" / "context_engine_client" / "_gen",
        "context_engine_client._gen",
    ),
)
# .proto files the TypeScript client loads at run time: (source root, path under it).
# googleapis-common-protos ships the google.rpc .proto sources beside its modules.
GOOGLEAPIS = Path(status_pb2.__file__).parent.parent.parent
TS_PROTO_ROOT = ROOT / "clients" / "typescript" / "proto"
PROTO_COPIES = (
    *((PROTO_ROOT, p.relative_to(PROTO_ROOT)) for p in sorted(PROTO_ROOT.rglob("*.proto"))),
    (GOOGLEAPIS, Path("google/rpc/status.proto")),
    (GOOGLEAPIS, Path("google/rpc/error_details.proto")),
)


def copy_protos(out: Path) -> None:
    for root, rel in PROTO_COPIES:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, out / rel)


def generate(out: Path, package: str = "context_engine._gen") -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in out.rglob("*.py*"):
        text = IMPORT_RE.sub(f"from {package}.context_engine.v1 import", path.read_text())
        path.write_text(text)
    for pkg in [out, out / "context_engine", out / "context_engine" / "v1"]:
        (pkg / "__init__.py").write_text(
            '"""Generated gRPC stubs. Do not edit; run `make proto`."""\n'
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="fail if stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outputs: list[tuple[Path, Path]] = []
        for index, (target, package) in enumerate(PY_TARGETS):
            out = Path(tmp) / f"py{index}" / "_gen"
            out.mkdir(parents=True)
            generate(out, package)
            outputs.append((out, target))
        copy_protos(Path(tmp) / "proto")
        outputs.append((Path(tmp) / "proto", TS_PROTO_ROOT))
        if args.check:
            stale = [
                f"{target.relative_to(ROOT)}: {name}"
                for out, target in outputs
                for name in (
                    _differences(filecmp.dircmp(out, target, ignore=["__pycache__"]))
                    if target.is_dir()
                    else ["(missing)"]
                )
            ]
            if stale:
                print("generated stubs are stale; run `make proto`:", *stale, sep="\n  ")
                return 1
            print("generated stubs are current")
            return 0
        for out, target in outputs:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(out, target)
            print(f"wrote {target.relative_to(ROOT)}")
    return 0


def _differences(cmp: filecmp.dircmp[str]) -> list[str]:
    found = [*cmp.left_only, *cmp.right_only, *cmp.diff_files]
    for sub in cmp.subdirs.values():
        found += _differences(sub)
    return found


if __name__ == "__main__":
    sys.exit(main())
