"""Prompt token counting: exact for token ids and with the model's tokenizer, an
over-estimate (never an under-estimate for ordinary text) without one."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from seawall.errors import ApiError
from seawall.protocol.tokens import (
    MEDIA_TOKENS,
    NON_PROMPT_ALLOWANCE_BYTES,
    PROMPT_BYTES_PER_TOKEN_CEILING,
    EstimateCounter,
    HFTokenizerCounter,
    check_prompt_bytes,
    completion_prompt_tokens,
    count_chat_prompt,
    count_completion_prompt,
    count_request,
    count_request_async,
    max_prompt_bytes,
)

# "Ordinary text": the standard library's docstrings, English prose with some code.
_DOC_MODULES = [
    "argparse",
    "asyncio",
    "collections",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "http",
    "inspect",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "unittest",
    "urllib",
    "uuid",
    "zipfile",
]


def _docstrings() -> list[str]:
    docs: list[str] = []
    for name in _DOC_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *vars(module).values()]:
            if obj is module or inspect.isfunction(obj) or inspect.isclass(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    docs.append(doc)
    return list(dict.fromkeys(docs))


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    docs = _docstrings()
    return docs[::2], docs[1::2]  # train, held out


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory: pytest.TempPathFactory, corpus: tuple[list[str], list[str]]) -> Path:
    """A byte-level BPE (GPT-2/Llama 3 style) with a BOS post-processor, trained locally."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus[0], trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_token_id_prompts_count_exactly() -> None:
    counter = EstimateCounter()
    assert count_completion_prompt([5, 6, 7], counter) == 3
    assert count_completion_prompt([[1, 2], [3, 4, 5], []], counter) == 5
    assert count_completion_prompt([], counter) == 0


def test_hf_counter_matches_the_tokenizer_including_bos(bpe_json: Path) -> None:
    counter = HFTokenizerCounter(bpe_json)
    tokenizer = Tokenizer.from_file(str(bpe_json))
    text = "Return a new list containing all items from the iterable in ascending order."
    assert counter.prompt_overhead_tokens == 1
    assert count_completion_prompt(text, counter) == len(tokenizer.encode(text).ids)
    batch = [text, "Sort the list in place."]
    assert count_completion_prompt(batch, counter) == sum(
        len(tokenizer.encode(t).ids) for t in batch
    )


def test_chat_content_parts_count_like_the_same_string_plus_media(bpe_json: Path) -> None:
    counter = HFTokenizerCounter(bpe_json)
    as_string = [{"role": "user", "content": "Describe the picture in one sentence."}]
    as_parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe the picture in one sentence."},
                {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}},
            ],
        }
    ]
    expected = (
        counter.reply_overhead_tokens
        + counter.message_overhead_tokens
        + counter.count_text("user")
        + counter.count_text("Describe the picture in one sentence.")
    )
    assert count_chat_prompt(as_string, counter) == expected
    # The image is charged its documented estimate: the encoder's cost is not known here.
    assert count_chat_prompt(as_parts, counter) == expected + MEDIA_TOKENS["image"]


def test_chat_counts_tool_calls_and_grows_with_each_message() -> None:
    counter = EstimateCounter()
    base: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    with_call = count_chat_prompt([*base, call], counter)
    assert with_call >= count_chat_prompt(base, counter) + counter.message_overhead_tokens + (
        counter.count_text('{"city": "Paris"}')
    )


@pytest.mark.parametrize(
    ("prompt", "param"),
    [({"text": "x"}, "prompt"), ([1.5], "prompt"), ([None], "prompt")],
)
def test_malformed_prompts_are_400s(prompt: Any, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        count_completion_prompt(prompt, EstimateCounter())
    assert caught.value.status == 400 and caught.value.param == param


def test_malformed_messages_are_400s() -> None:
    for messages in ("hello", ["hello"], [{"role": "user", "content": 3}]):
        with pytest.raises(ApiError) as caught:
            count_chat_prompt(messages, EstimateCounter())  # type: ignore[arg-type]
        assert caught.value.status == 400


def test_estimate_over_counts_a_real_bpe_on_held_out_prose(
    bpe_json: Path, corpus: tuple[list[str], list[str]]
) -> None:
    real, estimate = HFTokenizerCounter(bpe_json), EstimateCounter()
    held_out = corpus[1]
    assert len(held_out) > 100
    real_total = sum(real.count_text(doc) for doc in held_out)
    estimate_total = sum(estimate.count_text(doc) for doc in held_out)
    assert estimate_total >= 1.2 * real_total
    # Per document too, within a small margin for names the small vocabulary spells
    # letter by letter (a real 32k-150k vocabulary does better than this one).
    short = [d[:60] for d in held_out if estimate.count_text(d) < 0.9 * real.count_text(d)]
    assert short == []


def test_estimate_over_counts_the_emulators_tokenizer_on_prose(
    corpus: tuple[list[str], list[str]],
) -> None:
    textgen = pytest.importorskip("seawall.sim.textgen")
    estimate = EstimateCounter()
    for doc in corpus[1]:
        assert estimate.count_text(doc) >= len(textgen.tokenize(doc))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_estimate_never_below_emulator_or_a_third_of_the_bytes(text: str) -> None:
    textgen = pytest.importorskip("seawall.sim.textgen")
    estimate = EstimateCounter().count_text(text)
    assert estimate >= len(textgen.tokenize(text))
    assert estimate >= math.ceil(len(text.encode("utf-8", "surrogatepass")) / 3)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text()}
        ),
        min_size=1,
        max_size=5,
    )
)
def test_chat_estimate_never_below_the_emulators_chat_template(
    messages: list[dict[str, Any]],
) -> None:
    textgen = pytest.importorskip("seawall.sim.textgen")
    rendered = textgen.render_chat(messages)
    assert count_chat_prompt(messages, EstimateCounter()) >= len(textgen.tokenize(rendered))


# ---------------------------------------------- issue 11, item 6: nothing goes uncounted


def test_a_text_part_whose_text_is_not_a_string_is_refused_not_skipped() -> None:
    """Before: a `text` that was a list was skipped, so 3,816 prompt tokens (as the
    emulator rendered them) passed a 200-token tier limit."""
    words = ["the seawall holds against the storm"] * 100
    for text in (words, {"nested": words}, 12345, None):
        messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
        with pytest.raises(ApiError) as caught:
            count_chat_prompt(messages, EstimateCounter())
        assert caught.value.status == 400 and caught.value.param == "messages"


def test_every_message_field_and_request_field_that_reaches_the_prompt_is_counted() -> None:
    counter = EstimateCounter()
    padding = "lorem ipsum dolor sit amet " * 40
    base = [{"role": "user", "content": "hi"}]
    plain = count_chat_prompt(base, counter, {})
    at_least = counter.count_text(padding)
    variants: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
        ([{**base[0], "name": padding}], {}),
        ([{"role": "system", "content": padding}, *base], {}),
        ([{**base[0], "reasoning_content": padding}], {}),
        ([{**base[0], "unknown_field": {"deep": [padding]}}], {}),
        ([{"role": "user", "content": [{"type": "refusal", "refusal": padding}]}], {}),
        ([{"role": "user", "content": [{"type": "input_text", "text": padding}]}], {}),
        ([{"role": "user", "content": [{"type": "made_up", "x": padding}]}], {}),
        ([{"role": "user", "content": [padding]}], {}),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": padding}}],
                }
            ],
            {},
        ),
        (base, {"tools": [{"type": "function", "function": {"description": padding}}]}),
        (base, {"functions": [{"name": "f", "description": padding}]}),
        (base, {"documents": [{"title": "t", "text": padding}]}),
        (base, {"chat_template": "{{ messages }}" + padding}),
        (base, {"chat_template_kwargs": {"system": padding}}),
    ]
    for messages, request in variants:
        assert count_chat_prompt(messages, counter, request) >= plain + at_least - 8, (
            messages,
            request,
        )


def test_media_and_embedding_parts_are_charged() -> None:
    counter = EstimateCounter()
    base = count_chat_prompt([{"role": "user", "content": []}], counter)

    def with_part(part: dict[str, Any]) -> int:
        return count_chat_prompt([{"role": "user", "content": [part]}], counter) - base

    assert with_part({"type": "image_url", "image_url": {"url": "data:..."}}) == 2048
    assert with_part({"type": "input_audio", "input_audio": {"data": "..."}}) == 1500
    assert with_part({"type": "video_url", "video_url": {"url": "x"}}) == 8192
    # 100 rows of a 1,024-wide fp16 embedding, base64: at least 100 tokens charged.
    rows = "A" * (100 * 2048 * 4 // 3)
    assert with_part({"type": "image_embeds", "image_embeds": rows}) >= 100


def test_deeply_nested_fields_are_a_400_not_a_crash() -> None:
    deep: Any = "x"
    for _ in range(400):
        deep = {"a": deep}
    with pytest.raises(ApiError) as caught:
        count_chat_prompt([{"role": "user", "content": "hi", "extra": deep}], EstimateCounter())
    assert caught.value.status == 400


def _parsed(route: str, body: dict[str, Any]) -> Any:
    from seawall.protocol.openai import parse

    return parse(route, orjson.dumps(body))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "expected"),
    [(None, 1), (1, 1), (3, 3), (2.0, 2), ("4", 4), (True, 1)],
)
def test_n_is_read_as_vllm_reads_it(n: Any, expected: int) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "hi"}
    if n is not None:
        body["n"] = n
    assert _parsed("completions", body).n == expected
    assert (
        _parsed(
            "chat",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                **({"n": n} if n is not None else {}),
            },
        ).n
        == expected
    )


@pytest.mark.parametrize("n", [0, -2, 2.5, "many", [2], {"n": 2}])
def test_bad_n_is_a_400(n: Any) -> None:
    with pytest.raises(ApiError) as caught:
        _parsed("completions", {"model": "m", "prompt": "hi", "n": n})
    assert caught.value.status == 400 and caught.value.param == "n"


def test_a_batch_is_counted_as_every_prompt_times_n() -> None:
    """Before: `"prompt": [[...]] * 200` with max_tokens 64 returned 200 choices and
    12,800 completion tokens while admission counted one sequence."""
    ids = list(range(100, 120))
    req = _parsed("completions", {"model": "m", "prompt": [ids] * 200, "n": 2})
    count = count_request(req, EstimateCounter())
    assert count.num_prompts == 200 and count.sequences == 400
    assert count.prompt_tokens == 200 * 20 and count.largest_prompt_tokens == 20
    assert count.max_completion_tokens(64) == 400 * 64
    assert count.kv_tokens(64) == 400 * (20 + 64)
    assert count.kv_tokens(64, max_model_len=50) == 400 * 50
    best = _parsed("completions", {"model": "m", "prompt": "x", "n": 2, "best_of": 5})
    assert count_request(best, EstimateCounter()).sequences == 5


def test_suffix_and_prompt_embeds_are_counted() -> None:
    counter = EstimateCounter()
    plain = count_request(_parsed("completions", {"model": "m", "prompt": ["a", "b"]}), counter)
    suffixed = count_request(
        _parsed("completions", {"model": "m", "prompt": ["a", "b"], "suffix": "tail " * 50}),
        counter,
    )
    assert suffixed.prompt_tokens >= plain.prompt_tokens + 2 * counter.count_text("tail " * 50)
    embeds = count_request(
        _parsed("completions", {"model": "m", "prompt_embeds": ["A" * 300_000]}), counter
    )
    assert embeds.num_prompts == 1 and embeds.prompt_tokens >= 200


# Arbitrary JSON, as a hostile client may send it anywhere in a request.
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "text", "x", "role"]) | st.text(max_size=5),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)
_part = (
    st.text()
    | st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", "refusal", "weird"]), "text": _json}
    )
    | st.fixed_dictionaries({"type": st.just("text"), "text": st.text()})
    | _json
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]) | _json,
        "content": st.text() | st.lists(_part, max_size=4) | _json,
    },
    optional={"name": _json, "tool_calls": _json, "extra": _json},
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_message, min_size=1, max_size=4))
def test_no_chat_shape_the_emulator_renders_is_under_counted(messages: list[Any]) -> None:
    """Whatever JSON a client sends as `messages`: either a 400, or a count at least
    what the emulator's chat template renders and tokenizes."""
    textgen = pytest.importorskip("seawall.sim.textgen")
    try:
        counted = count_chat_prompt(messages, EstimateCounter(), {})
    except ApiError as e:
        assert e.status == 400
        return
    try:
        rendered = textgen.render_chat(messages)
    except textgen.ChatTemplateError:
        return  # the engine refuses it too
    assert counted >= len(textgen.tokenize(rendered))


@settings(max_examples=300, deadline=None)
@given(
    _json
    | st.lists(st.integers(0, 200_000))
    | st.lists(st.text(), min_size=1)
    | st.lists(st.lists(st.integers(0, 200_000)), min_size=1)
)
def test_no_completion_prompt_shape_is_under_counted(prompt: Any) -> None:
    """Any `prompt`: a 400, or per prompt at least the emulator's token count, and
    exactly as many prompts as the emulator would answer."""
    textgen = pytest.importorskip("seawall.sim.textgen")
    try:
        per_prompt = completion_prompt_tokens(prompt, EstimateCounter())
    except ApiError as e:
        assert e.status == 400
        return
    if isinstance(prompt, str):
        engine = [textgen.tokenize(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        engine = [textgen.tokenize(p) for p in prompt]
    elif prompt and all(isinstance(p, list) for p in prompt):
        engine = list(prompt)
    else:
        engine = [prompt]
    assert len(per_prompt) == len(engine)
    for counted, ids in zip(per_prompt, engine, strict=True):
        assert counted >= len(ids)


# ------------------------------------------ issue 11, item 5: bounded before counting


def test_the_byte_bound_refuses_a_huge_prompt_before_counting() -> None:
    limit = max_prompt_bytes(200)
    assert limit == 200 * PROMPT_BYTES_PER_TOKEN_CEILING + NON_PROMPT_ALLOWANCE_BYTES
    error = check_prompt_bytes(3_800_000, limit)
    assert error is not None and error.status == 413 and str(limit) in error.message
    assert check_prompt_bytes(limit, limit) is None
    assert check_prompt_bytes(10**9, max_prompt_bytes(None)) is None


@settings(max_examples=300, deadline=None)
@given(
    st.text(min_size=1, max_size=2000)
    | st.lists(st.integers(0, 99_999_999), min_size=1, max_size=500),
    st.booleans(),
)
def test_the_byte_bound_never_refuses_a_prompt_the_count_would_admit(
    prompt: Any, spaced: bool
) -> None:
    """For any prompt the estimator counts at L tokens, the body with that prompt (as
    orjson or Python's json writes it, ids up to 8 digits) fits the bound of a tier
    whose limit is exactly L."""
    import json

    counted = count_completion_prompt(prompt, EstimateCounter())
    body = {"model": "some-model-name", "prompt": prompt, "max_tokens": 16}
    raw = json.dumps(body).encode() if spaced else orjson.dumps(body)
    assert check_prompt_bytes(len(raw), max_prompt_bytes(counted)) is None


async def test_large_bodies_are_counted_off_the_event_loop() -> None:
    """A counter that can only finish once the event loop has run another task: counted
    on the loop, it would wait for ever (bounded here at 5 s and failing)."""
    loop_ran = threading.Event()
    counted_on: list[int] = []

    class NeedsTheLoop(EstimateCounter):
        def count_text(self, text: str) -> int:
            counted_on.append(threading.get_ident())
            if len(text) > 1000 and not loop_ran.wait(timeout=5.0):
                raise AssertionError("the event loop was blocked while counting")
            return super().count_text(text)

    req = _parsed("completions", {"model": "m", "prompt": "word " * 20_000})

    async def tick() -> None:
        loop_ran.set()

    ticker = asyncio.get_running_loop().create_task(tick())
    count = await count_request_async(req, NeedsTheLoop())
    await ticker
    assert count.prompt_tokens > 20_000
    assert threading.get_ident() not in counted_on  # counted in the worker thread
    small = _parsed("completions", {"model": "m", "prompt": "short"})
    counted_on.clear()
    await count_request_async(small, NeedsTheLoop())
    assert counted_on == [threading.get_ident()]  # small bodies stay inline


@settings(max_examples=2000, deadline=None)
@given(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(alphabet="0123456789 +-._e", max_size=8)
    | st.text(max_size=6)
)
def test_lax_int_never_reads_a_number_pydantic_reads_differently(value: Any) -> None:
    """vLLM validates `n` with pydantic: wherever this parser reads an integer,
    pydantic reads the same one (so the gateway counts what the engine runs)."""
    from pydantic import TypeAdapter, ValidationError

    from seawall.protocol.openai import lax_int

    ours = lax_int(value)
    if ours is None:
        return
    try:
        theirs = TypeAdapter(int).validate_python(value)
    except ValidationError:
        pytest.fail(f"{value!r}: read as {ours}, pydantic refuses it")
    assert ours == theirs


def test_a_tier_byte_bound_is_derived_from_its_prompt_limit_or_set() -> None:
    from seawall.config import TierConfig

    assert TierConfig().prompt_bytes_limit() is None
    assert TierConfig(max_prompt_tokens=200).prompt_bytes_limit() == max_prompt_bytes(200)
    assert TierConfig(max_prompt_tokens=200, max_prompt_bytes=5000).prompt_bytes_limit() == 5000
