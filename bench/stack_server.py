"""`context-engine serve` with Build's work taken away: the service's own per-call stack.

Engine.build is memoized on its arguments, so after the first call a Build makes no
PostgreSQL round trip and assembles nothing; everything else still runs per call, as in
the real server: the interceptors (telemetry observer, drain, size limit, error mapping),
request parsing, the BuildResponse composed from its memoized pieces, serialization and
grpc itself. bench.transport measures it between the echo and the real Build to show
how much of a Build is the stack and how much the storage and assembly. Bench only: a
response memo keyed on the whole request would measure the memo, not Build, and the
service does not have one (docs/performance.md)."""

from __future__ import annotations

import sys
from typing import Any

from context_engine import cli
from context_engine.api.engine import BuildResult, Engine

_real_build = Engine.build


async def _memoized_build(self: Engine, *args: Any, **kwargs: Any) -> BuildResult:
    key = repr((args, sorted(kwargs.items())))
    memo: dict[str, BuildResult] = self.__dict__.setdefault("_bench_builds", {})
    if key not in memo:
        memo[key] = await _real_build(self, *args, **kwargs)
    return memo[key]


def main() -> int:
    Engine.build = _memoized_build  # type: ignore[method-assign]
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
