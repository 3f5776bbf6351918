"""The emulator's text: a round-tripping tokenizer and a continuation-stable generator."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from seawall.sim import textgen


def generate(prompt_ids: list[int], n: int, key: int, stop_at_eos: bool = False) -> list[int]:
    h = textgen.hash_tokens(prompt_ids)
    out: list[int] = []
    for _ in range(n):
        tok = textgen.next_token(key, h)
        out.append(tok)
        h = textgen.extend_hash(h, tok)
        if stop_at_eos and tok == textgen.EOS_ID:
            break
    return out


GREEDY = textgen.sampling_key(0, 0.0, None)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips_through_the_tokenizer(text: str) -> None:
    ids = textgen.tokenize(text)
    assert textgen.detokenize(ids) == text
    assert all(textgen.is_valid_token(t) for t in ids)


@settings(max_examples=100, deadline=None)
@given(prompt=st.text(max_size=80), n=st.integers(1, 60), cut=st.integers(0, 60))
def test_resending_prompt_plus_partial_text_continues_the_same_output(
    prompt: str, n: int, cut: int
) -> None:
    """What mid-stream migration relies on: text of a partial output re-tokenizes to the
    same tokens after the prompt, and the rest of the output is the same."""
    prompt_ids = textgen.tokenize(prompt)
    full = generate(prompt_ids, n, GREEDY, stop_at_eos=True)
    body = full[:-1] if full[-1] == textgen.EOS_ID else full
    cut = min(cut, len(body))
    partial_text = textgen.detokenize(body[:cut], skip_special=True)
    resent = textgen.tokenize(prompt + partial_text)
    assert resent == prompt_ids + body[:cut]
    assert generate(resent, len(full) - cut, GREEDY, stop_at_eos=True) == full[cut:]


def test_chat_continue_final_message_renders_prompt_then_partial() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Tell me, a story!"}]},
    ]
    prompt_ids = textgen.tokenize(textgen.render_chat(messages))
    full = generate(prompt_ids, 40, GREEDY)
    full = full[: full.index(textgen.EOS_ID)] if textgen.EOS_ID in full else full
    for cut in (1, 7, len(full) // 2):
        partial = textgen.detokenize(full[:cut], skip_special=True)
        resent = textgen.render_chat(
            [*messages, {"role": "assistant", "content": partial}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
        resent_ids = textgen.tokenize(resent)
        assert resent_ids == prompt_ids + full[:cut]
        assert generate(resent_ids, len(full) - cut, GREEDY) == full[cut:]


def test_output_depends_on_context_not_position_and_seed_changes_sampling() -> None:
    a = generate(textgen.tokenize("The same prompt"), 30, GREEDY)
    assert a == generate(textgen.tokenize("The same prompt"), 30, GREEDY)
    assert a != generate(textgen.tokenize("Another prompt"), 30, GREEDY)
    # greedy ignores the request seed; sampling follows it
    assert textgen.sampling_key(0, 0.0, 1) == textgen.sampling_key(0, 0.0, 2)
    s1 = textgen.sampling_key(0, 0.8, 1)
    assert s1 == textgen.sampling_key(0, 0.8, 1)
    assert s1 != textgen.sampling_key(0, 0.8, 2)
    prompt = textgen.tokenize("The same prompt")
    assert generate(prompt, 30, s1) != generate(prompt, 30, textgen.sampling_key(0, 0.8, 2))


def test_generated_text_has_words_punctuation_and_sometimes_ends() -> None:
    out = generate(textgen.tokenize("x"), 5000, GREEDY)
    text = textgen.detokenize(out, skip_special=True)
    assert "," in text and "." in text and text.startswith((" ", ",", "."))
    assert textgen.EOS_ID in out
    ids = textgen.tokenize("".join(textgen.token_text(t) for t in out))
    assert ids == [t for t in out if t != textgen.EOS_ID]


def test_both_flags_true_is_the_vllm_error() -> None:
    try:
        textgen.render_chat([{"role": "user", "content": "x"}], True, True)
    except textgen.ChatTemplateError as e:
        assert "continue_final_message" in str(e)
    else:
        raise AssertionError("expected ChatTemplateError")
