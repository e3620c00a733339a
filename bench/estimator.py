"""Signed error of the token estimator against the exact tokenizers on a mixed real-text corpus.

    python -m bench.estimator [--chunk-chars N] [--tiktoken-dir DIR] [--show-worst K]

Corpus (all offline, all deterministic):
  code      the running interpreter's standard-library ``*.py`` files;
  prose     standard-library docstrings, the CPython LICENSE text and the pydoc topic pages;
  json      tool-output-shaped JSON generated from a fixed seed (ids, hashes, base64, URLs,
            timestamps, numbers, nested objects, with and without indentation);
  ids       id-dense text generated from a fixed seed: ULIDs, all-caps keys and access
            keys, short base64 and base64url, nano ids, prefixed keys, upper-case hex and
            UUIDs, one per line, as a JSON list of records, or among words
            (core/estimator.py's known limits: the alphabets its fit saw least);
  non-latin ``bench/corpus/non_latin.txt``: CJK, Hangul, Cyrillic, Greek, Arabic, Devanagari
            and accented/non-English Latin paragraphs written for this benchmark.
Files are cut at line (or paragraph) boundaries into message-sized samples of at most
``--chunk-chars`` characters; samples under 32 exact tokens are skipped because rounding and
the heuristic's per-text edge constant dominate them.

Families: the OpenAI models estimate with their own tokenizer (o200k_base, cl100k_base), so their
error is the estimator's rounding only; Anthropic models have no public tokenizer and use the
heuristic, measured against *each* exact tokenizer as a proxy. Errors are text-level ratios
(estimate - actual) / actual, without message framing and with correction factor 1.0.

The bar (exit status 1 if it fails): no family is ever under by more than 5% (the allocator's
safety margin) on any sample; and where no exact tokenizer exists, the mean over-estimate on
ordinary English and code (code, prose, json) is at most 15%. Non-Latin text and ids are
reported but not held to the over-estimate bar: the heuristic must cover cl100k on
non-Latin text, which spends 1.5-3x the tokens of o200k on it, and ids are what it prices
most cautiously.
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import random
import re
import statistics
import string
import sys
import sysconfig
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from context_engine.core.estimator import ModelTokenEstimator
from context_engine.model_registry_loader import load_model_registry
from context_engine.tokenizers import build_counters

UNDER_BAR = -0.05
OVER_BAR = 0.15
MIN_TOKENS = 32
ORDINARY = ("code", "prose", "json")
CORPUS_FILE = Path(__file__).parent / "corpus" / "non_latin.txt"
_JSON_KEYS = (
    *("id", "name", "status", "created_at", "updated_at", "owner", "email", "url", "title"),
    *("description", "items", "total", "count", "page", "next_cursor", "error", "message"),
    *("code", "tags", "score", "active", "region", "latency_ms"),
)
_JSON_SENTENCE = (
    "the request failed because the upstream service returned an unexpected status while "
    "the user was uploading a large file to the shared workspace folder"
)

# model id -> (family label, proxy tokenizers to compare against)
FAMILIES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("gpt-4o", "openai o200k_base (exact)", ("o200k_base",)),
    ("gpt-4", "openai cl100k_base (exact)", ("cl100k_base",)),
    ("claude-sonnet-4-5", "anthropic heuristic", ("o200k_base", "cl100k_base")),
)


@dataclass(frozen=True)
class Sample:
    category: str
    name: str
    text: str


# --- corpus -----------------------------------------------------------------------------------


def _chunks(text: str, limit: int, separator: str = "\n") -> Iterator[str]:
    """Cut ``text`` at ``separator`` boundaries into pieces of at most ``limit`` characters
    (a single longer piece is kept whole)."""
    buffer: list[str] = []
    size = 0
    for piece in text.split(separator):
        piece_size = len(piece) + len(separator)
        if buffer and size + piece_size > limit:
            yield separator.join(buffer)
            buffer, size = [], 0
        buffer.append(piece)
        size += piece_size
    if buffer:
        yield separator.join(buffer)


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_samples(limit: int) -> list[Sample]:
    samples = []
    for path in sorted(_stdlib().glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for i, chunk in enumerate(_chunks(text, limit)):
            samples.append(Sample("code", f"{path.name}#{i}", chunk))
    return samples


def prose_samples(limit: int) -> list[Sample]:
    documents: list[tuple[str, str]] = []
    license_file = _stdlib() / "LICENSE.txt"
    if license_file.is_file():
        documents.append(("LICENSE.txt", license_file.read_text(encoding="utf-8")))
    for path in sorted(_stdlib().glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
        text = "\n\n".join(d for d in docstrings if d)
        if text:
            documents.append((f"docstrings:{path.name}", text))
    topics_file = _stdlib() / "pydoc_data" / "topics.py"
    if topics_file.is_file():
        topics = ast.literal_eval(topics_file.read_text(encoding="utf-8").split("=", 1)[1].strip())
        documents.extend((f"topic:{key}", topics[key]) for key in sorted(topics))
    samples = []
    for name, text in documents:
        for i, chunk in enumerate(_chunks(text, limit, "\n\n")):
            samples.append(Sample("prose", f"{name}#{i}", chunk))
    return samples


def json_samples(count: int = 300, seed: int = 20240607) -> list[Sample]:
    rng = random.Random(seed)
    words = _JSON_KEYS
    sentence_words = _JSON_SENTENCE.split(" ")

    def scalar() -> object:
        kind = rng.randrange(10)
        if kind == 0:
            return rng.randint(0, 10 ** rng.randint(1, 12))
        if kind == 1:
            return round(rng.uniform(-1e4, 1e4), rng.randint(0, 6))
        if kind == 2:
            return rng.choice([True, False, None])
        if kind == 3:
            return " ".join(rng.choice(sentence_words) for _ in range(rng.randint(1, 14)))
        if kind == 4:
            return str(uuid.UUID(int=rng.getrandbits(128)))
        if kind == 5:
            return hashlib.sha256(rng.randbytes(8)).hexdigest()[: rng.randint(8, 64)]
        if kind == 6:
            return base64.b64encode(rng.randbytes(rng.randint(3, 48))).decode()
        if kind == 7:
            month, day, hour = rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23)
            return f"2025-{month:02d}-{day:02d}T{hour:02d}:00:00Z"
        if kind == 8:
            return f"https://api.example.com/v1/{rng.choice(words)}/{rng.randint(1, 99999)}"
        return rng.choice(words)

    def value(depth: int) -> object:
        roll = rng.random()
        if depth >= 3 or roll < 0.35:
            return scalar()
        if roll < 0.7:
            return {rng.choice(words): value(depth + 1) for _ in range(rng.randint(1, 6))}
        return [value(depth + 1) for _ in range(rng.randint(0, 6))]

    samples = []
    for i in range(count):
        document = {"results": [value(0) for _ in range(rng.randint(1, 10))]}
        text = json.dumps(document, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)
        samples.append(Sample("json", f"tool-output-{i}", text))
    return samples


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_ALNUM = string.ascii_letters + string.digits


def id_samples(count: int = 300, seed: int = 20261206) -> list[Sample]:
    rng = random.Random(seed)

    def pick(alphabet: str, length: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(length))

    makers: tuple[Callable[[], str], ...] = (
        lambda: pick(_CROCKFORD, 26),  # ULID
        lambda: "_".join(pick(string.ascii_uppercase, rng.randint(2, 8)) for _ in range(3)),
        lambda: "AKIA" + pick(string.ascii_uppercase + string.digits, 16),  # access key
        lambda: base64.b64encode(rng.randbytes(rng.randint(3, 12))).decode(),
        lambda: base64.urlsafe_b64encode(rng.randbytes(16)).decode().rstrip("="),
        lambda: pick(_ALNUM + "_-", 21),  # nano id
        lambda: "cus_" + pick(_ALNUM, 14),
        lambda: rng.randbytes(8).hex().upper(),
        lambda: str(uuid.UUID(int=rng.getrandbits(128))).upper(),
        lambda: pick(string.ascii_lowercase + string.digits, rng.randint(4, 8)),
    )
    words = _JSON_SENTENCE.split(" ")
    samples = []
    for i in range(count):
        make = makers[i % len(makers)]
        ids = [make() for _ in range(rng.randint(2, 40))]
        layout = (i // len(makers)) % 3
        if layout == 0:
            text = "\n".join(ids)
        elif layout == 1:
            text = json.dumps([{"id": v, "status": rng.choice(words)} for v in ids])
        else:
            text = " ".join(f"{rng.choice(words)} {v}" for v in ids)
        samples.append(Sample("ids", f"ids-{i}", text))
    return samples


def non_latin_samples() -> list[Sample]:
    text = CORPUS_FILE.read_text(encoding="utf-8")
    sections = re.split(r"^## (\S+)\n", text, flags=re.MULTILINE)[1:]
    samples: list[Sample] = []
    for language, body in zip(sections[::2], sections[1::2], strict=True):
        paragraphs = [p.strip() for p in body.split("\n\n") if p.strip()]
        samples.extend(Sample("non-latin", f"{language}#{i}", p) for i, p in enumerate(paragraphs))
        if len(paragraphs) > 1:
            samples.append(Sample("non-latin", f"{language}#all", "\n\n".join(paragraphs)))
    return samples


# --- measurement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    samples: int
    mean: float
    aggregate: float
    worst_under: float
    worst_over: float
    worst_under_name: str

    @classmethod
    def of(cls, rows: Sequence[tuple[str, int, int]]) -> Stats:
        errors = [((estimate - actual) / actual, name) for name, estimate, actual in rows]
        low = min(errors)
        return cls(
            samples=len(rows),
            mean=statistics.fmean(e for e, _ in errors),
            aggregate=sum(r[1] for r in rows) / sum(r[2] for r in rows) - 1,
            worst_under=min(0.0, low[0]),
            worst_over=max(0.0, max(e for e, _ in errors)),
            worst_under_name=low[1],
        )


def _measure(
    samples: Sequence[Sample],
    estimate: Callable[[str], int],
    actual: Callable[[str], int],
) -> dict[str, list[tuple[str, int, int]]]:
    rows: dict[str, list[tuple[str, int, int]]] = {}
    for sample in samples:
        exact = actual(sample.text)
        if exact < MIN_TOKENS:
            continue
        rows.setdefault(sample.category, []).append((sample.name, estimate(sample.text), exact))
    return rows


def _pct(value: float) -> str:
    return f"{value * 100:+.1f}%"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-chars", type=int, default=4000)
    parser.add_argument("--tiktoken-dir", default=None, help="rank-file directory (offline)")
    parser.add_argument("--show-worst", type=int, default=0, help="list the K worst samples")
    args = parser.parse_args(argv)

    counters = build_counters(args.tiktoken_dir)
    missing = {"o200k_base", "cl100k_base"} - set(counters)
    if missing:
        print(f"cannot run: exact tokenizer(s) {sorted(missing)} not available", file=sys.stderr)
        return 2
    estimator = ModelTokenEstimator(load_model_registry(), counters)
    samples = [
        *code_samples(args.chunk_chars),
        *prose_samples(args.chunk_chars),
        *json_samples(),
        *id_samples(),
        *non_latin_samples(),
    ]
    print(
        f"corpus: {len(samples)} samples, {sum(len(s.text) for s in samples):,} characters "
        f"(stdlib {_stdlib()}; chunks <= {args.chunk_chars} chars; samples < {MIN_TOKENS} tokens "
        "skipped)\n"
    )
    header = (
        f"{'family':<28} {'vs':<12} {'category':<10} {'n':>5} {'mean':>8} {'aggregate':>10} "
        f"{'worst under':>12} {'worst over':>11}  bar"
    )
    print(header)
    print("-" * len(header))
    failures: list[str] = []
    for model_id, label, proxies in FAMILIES:
        heuristic = not estimator.is_exact(model_id)

        def estimate(text: str, model_id: str = model_id) -> int:
            return estimator.estimate_text(text, model_id)

        for proxy in proxies:
            rows = _measure(samples, estimate, counters[proxy].count_text)
            categories = [*sorted(rows), "all"]
            for category in categories:
                chosen = (
                    [row for group in rows.values() for row in group]
                    if category == "all"
                    else rows[category]
                )
                stats = Stats.of(chosen)
                verdict = "ok"
                if stats.worst_under < UNDER_BAR:
                    verdict = "FAIL under"
                    failures.append(
                        f"{label} vs {proxy} [{category}] under {stats.worst_under:.1%}"
                    )
                elif heuristic and category in ORDINARY and stats.mean > OVER_BAR:
                    verdict = "FAIL over"
                    failures.append(f"{label} vs {proxy} [{category}] mean over {stats.mean:.1%}")
                elif heuristic and category not in ORDINARY:
                    verdict = "ok (no over bar)"
                print(
                    f"{label:<28} {proxy:<12} {category:<10} {stats.samples:>5} "
                    f"{_pct(stats.mean):>8} {_pct(stats.aggregate):>10} "
                    f"{_pct(stats.worst_under):>12} {_pct(stats.worst_over):>11}  {verdict}"
                )
                if args.show_worst and category != "all":
                    worst = sorted(chosen, key=lambda r: (r[1] - r[2]) / r[2])[: args.show_worst]
                    for name, est, act in worst:
                        print(f"{'':>42}{name}: {est} vs {act} ({_pct((est - act) / act)})")
            print()
    print(
        f"bar: never under by more than {-UNDER_BAR:.0%} on any sample; heuristic mean over "
        f"<= {OVER_BAR:.0%} on {', '.join(ORDINARY)}"
    )
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
