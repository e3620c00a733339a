"""Generate the committed gRPC stubs from proto/ into service/context_engine/_gen.

protoc writes imports as `from context_engine.v1 import ...`, which would collide with our
own top-level `context_engine` package, so the imports are rewritten to the private
`context_engine._gen` package. `--check` regenerates into a temporary directory and exits 1
when the committed stubs differ (CI runs it).
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

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
TARGET = ROOT / "service" / "context_engine" / "_gen"
IMPORT_RE = re.compile(r"^from context_engine\.v1 import", re.MULTILINE)


def generate(out: Path) -> None:
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
        text = IMPORT_RE.sub("from context_engine._gen.context_engine.v1 import", path.read_text())
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
        out = Path(tmp) / "_gen"
        out.mkdir()
        generate(out)
        if args.check:
            cmp = filecmp.dircmp(out, TARGET, ignore=["__pycache__"])
            stale = _differences(cmp)
            if stale:
                print("generated stubs are stale; run `make proto`:", *stale, sep="\n  ")
                return 1
            print("generated stubs are current")
            return 0
        shutil.rmtree(TARGET, ignore_errors=True)
        shutil.copytree(out, TARGET)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


def _differences(cmp: filecmp.dircmp[str]) -> list[str]:
    found = [*cmp.left_only, *cmp.right_only, *cmp.diff_files]
    for sub in cmp.subdirs.values():
        found += _differences(sub)
    return found


if __name__ == "__main__":
    sys.exit(main())
