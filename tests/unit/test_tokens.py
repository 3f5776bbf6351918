"""Prompt token counting: exact for token ids and with the model's tokenizer, an
over-estimate (never an under-estimate for ordinary text) without one."""

from __future__ import annotations

import importlib
import inspect
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from seawall.errors import ApiError
from seawall.protocol.tokens import (
    EstimateCounter,
    HFTokenizerCounter,
    count_chat_prompt,
    count_completion_prompt,
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


def test_chat_content_parts_count_like_the_same_string(bpe_json: Path) -> None:
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
    assert count_chat_prompt(as_parts, counter) == expected


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
