"""`make bench`: every benchmark in one run, each printing ratios against a baseline
measured in the same run, then a summary of which bars hold. Speed is reported here, never
asserted in tests. LangChain is installed only in this environment (.venv-bench)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from . import (
    estimator,
    growth,
    langchain_compare,
    load,
    loop_stall,
    plan_cost,
    session_length,
    transport,
    usage_contention,
)

# (name, runner, arguments for a full run, arguments for --quick)
SUITE: tuple[tuple[str, Callable[[list[str]], int], list[str], list[str]], ...] = (
    ("estimator error", estimator.main, [], []),
    ("Build vs transport ceiling", transport.main, ["--seconds", "15"], ["--seconds", "5"]),
    (
        "cost vs session length",
        session_length.main,
        [],
        ["--lengths", "50,500", "--builds", "10", "--cold-servers", "1"],
    ),
    ("vs LangChain trim_messages", langchain_compare.main, [], ["--seconds", "1"]),
    ("plan cost", plan_cost.main, [], ["--calls", "10"]),
    ("loop stall under hostile content", loop_stall.main, [], ["--repeat", "1"]),
    ("input growth", growth.main, [], ["--factor", "4", "--repeat", "1"]),
    ("load (60 s)", load.main, [], ["--seconds", "10"]),
    ("usage reports sharing a correction", usage_contention.main, [], ["--seconds", "3"]),
    ("faults: PostgreSQL restart", load.main, ["--faults"], ["--faults", "--seconds", "15"]),
    (
        "faults: PostgreSQL crash (immediate stop)",
        load.main,
        ["--faults", "--stop", "immediate"],
        ["--faults", "--stop", "immediate", "--seconds", "15"],
    ),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--only", default="", help="comma-separated name fragments")
    args = parser.parse_args(argv)
    results: list[tuple[str, int]] = []
    for name, run, full, quick in SUITE:
        if args.only and not any(f in name for f in args.only.split(",")):
            continue
        print(f"\n=== {name}", flush=True)
        results.append((name, run(quick if args.quick else full)))
    print("\n=== summary")
    for name, code in results:
        print(f"  {'PASS' if code == 0 else 'FAIL'}  {name}")
    return 0 if all(code == 0 for _, code in results) else 1


if __name__ == "__main__":
    sys.exit(main())
