"""The emulator's scheduler core: block accounting, admission, preemption, finishing."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seawall.sim import textgen
from seawall.sim.scheduler import (
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SimRequest,
    StepCosts,
    total_held_blocks,
)


def _req(
    rid: str, prompt_len: int, max_tokens: int, ignore_eos: bool = True, shared: bool = False
) -> SimRequest:
    """A request whose prompt is its own (no prefix-cache hits) unless `shared`."""
    salt = 0 if shared else zlib.crc32(rid.encode())
    return SimRequest(
        request_id=rid,
        prompt_ids=[textgen.WORD_BASE + ((salt + i) % 500) for i in range(prompt_len)],
        max_tokens=max_tokens,
        key=7,
        ignore_eos=ignore_eos,
    )


def _held(s: Scheduler) -> int:
    return total_held_blocks([*s.running, *s.waiting])


def _assert_invariants(s: Scheduler) -> None:
    held_ids = [b for r in (*s.running, *s.waiting) for b in r.block_ids]
    assert 0 <= s.free_blocks <= s.usable_blocks
    # every reference is a request's, and each held block is held by someone
    assert s.pool.total_refs() == len(held_ids) == _held(s)
    assert len(set(held_ids)) == s.usable_blocks - s.free_blocks
    for r in (*s.running, *s.waiting):
        assert len(set(r.block_ids)) == len(r.block_ids)
    assert 0.0 <= s.kv_usage() <= 1.0
    assert len(s.running) <= s.config.max_num_seqs


def test_kv_usage_counts_the_null_block_as_vllm_does() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=11, block_size=4, max_model_len=40))
    s.add(_req("a", prompt_len=8, max_tokens=4))
    s.step()
    # 8 prompt tokens = 2 blocks out of 10 usable (11 minus the null block)
    assert s.kv_usage() == pytest.approx(0.2)


def test_a_prompt_that_does_not_fit_waits_and_stops_admission_behind_it() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=5, block_size=4, max_model_len=16))
    s.add(_req("big", prompt_len=12, max_tokens=4))  # 3 blocks
    s.add(_req("huge", prompt_len=16, max_tokens=1))  # 4 blocks: cannot fit beside "big"
    s.add(_req("tiny", prompt_len=1, max_tokens=1))  # would fit, but FCFS stops at "huge"
    s.step()
    assert [r.request_id for r in s.running] == ["big"]
    assert [r.request_id for r in s.waiting] == ["huge", "tiny"]


def test_chunked_prefill_spreads_a_long_prompt_over_steps_before_the_first_token() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=16, max_num_batched_tokens=100))
    s.add(_req("a", prompt_len=250, max_tokens=3))
    firsts = [len(s.step().outputs) for _ in range(3)]
    assert firsts == [0, 0, 1]  # 100 + 100 + 50 prompt tokens, then the first token


def test_step_cost_grows_with_prefill_tokens_and_batch_size() -> None:
    costs = StepCosts(base_s=0.01, per_seq_s=0.001, per_prefill_token_s=0.0001)
    s = Scheduler(SchedulerConfig(num_blocks=1000, costs=costs))
    s.add(_req("a", prompt_len=100, max_tokens=5))
    prefill = s.step()
    assert prefill.cost_s == 0.01 + 0.001 + 0.0001 * 100
    decode = s.step()
    assert decode.cost_s == 0.01 + 0.001
    for i in range(9):
        s.add(_req(f"b{i}", prompt_len=1, max_tokens=5))
    s.step()
    assert s.step().cost_s == 0.01 + 0.001 * 10


def test_preemption_frees_the_newest_and_requeues_it_first_and_everyone_finishes() -> None:
    # 8 usable blocks of 4 tokens: three 8-token prompts fit (6 blocks), growth does not
    s = Scheduler(SchedulerConfig(num_blocks=9, block_size=4, max_model_len=32))
    for name in ("a", "b", "c"):
        s.add(_req(name, prompt_len=8, max_tokens=12))
    preempted: list[str] = []
    outputs: dict[str, int] = {"a": 0, "b": 0, "c": 0}
    finished: list[str] = []
    for _ in range(200):
        result = s.step()
        preempted += [r.request_id for r in result.preempted]
        for r, _tok in result.outputs:
            outputs[r.request_id] += 1
        finished += [r.request_id for r in result.finished]
        _assert_invariants(s)
        if not s.has_work():
            break
    assert preempted and preempted[0] == "c"  # the newest running request goes first
    assert s.num_preemptions_total == len(preempted)
    assert sorted(finished) == ["a", "b", "c"]
    assert outputs == {"a": 12, "b": 12, "c": 12}  # recompute keeps the output so far
    assert s.free_blocks == s.usable_blocks


def test_a_preempted_request_continues_with_the_same_tokens() -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        s = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=32))
        reqs = [_req(n, prompt_len=8, max_tokens=12) for n in ("a", "b", "c")]
        for r in reqs:
            s.add(r)
        while s.has_work():
            s.step()
        return {r.request_id: r.output_ids for r in reqs}, s.num_preemptions_total

    tight, tight_preemptions = run(9)
    roomy, roomy_preemptions = run(100)
    assert tight_preemptions > 0 and roomy_preemptions == 0
    assert tight == roomy


def test_eos_finishes_with_stop_unless_ignored_and_length_caps_output() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=4000, max_model_len=4096))
    stoppers = [_req(f"s{i}", prompt_len=4, max_tokens=3000, ignore_eos=False) for i in range(8)]
    for i, r in enumerate(stoppers):
        r.key = i + 1  # distinct token streams
        s.add(r)
    capped = _req("capped", prompt_len=4, max_tokens=50, ignore_eos=True)
    s.add(capped)
    while s.has_work():
        s.step()
    assert capped.finish_reason is FinishReason.LENGTH and capped.num_output == 50
    reasons = {r.finish_reason for r in stoppers}
    assert FinishReason.STOP in reasons
    for r in stoppers:
        if r.finish_reason is FinishReason.STOP:
            assert r.output_ids[-1] == textgen.EOS_ID


def test_max_model_len_caps_prompt_plus_output() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_model_len=20))
    r = _req("a", prompt_len=15, max_tokens=100)
    s.add(r)
    while s.has_work():
        s.step()
    assert r.num_tokens == 20 and r.finish_reason is FinishReason.LENGTH


def test_abort_frees_blocks_at_once() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4))
    s.add(_req("a", prompt_len=40, max_tokens=10))
    s.add(_req("b", prompt_len=8, max_tokens=10))
    s.step()
    assert s.free_blocks < s.usable_blocks
    s.abort("a")
    s.abort("b")
    assert s.free_blocks == s.usable_blocks and not s.has_work()
    assert s.abort("a") is None


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 40)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=_ops,
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 64),
    caching=st.booleans(),
)
def test_block_accounting_holds_under_any_sequence_of_operations(
    ops: list[tuple[str, int, int]],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    caching: bool,
) -> None:
    max_model_len = (num_blocks - 1) * block_size
    s = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_prefix_caching=caching,
        )
    )
    added = 0
    for op, a, b in ops:
        if op == "add":
            prompt_len = min(a, max_model_len - 1)
            s.add(_req(f"r{added}", prompt_len, b, ignore_eos=bool(a % 2), shared=b % 3 == 0))
            added += 1
        elif op == "step":
            before = s.num_preemptions_total
            result = s.step()
            # a preemption is counted exactly when one happens
            assert s.num_preemptions_total - before == len(result.preempted)
            for r in result.preempted:
                assert (
                    r.num_blocks == 0 and r.num_computed == 0 and s.waiting[0] in result.preempted
                )
        else:
            s.abort(f"r{a}")
        _assert_invariants(s)
    # drain: every request completes and every block comes back
    for _ in range(20_000):
        if not s.has_work():
            break
        s.step()
        _assert_invariants(s)
    assert not s.has_work()
    assert s.free_blocks == s.usable_blocks
    assert s.kv_usage() == 0.0


def test_a_repeated_prompt_hits_the_prefix_cache_and_skips_that_prefill() -> None:
    costs = StepCosts(base_s=0.0, per_seq_s=0.0, per_prefill_token_s=1.0)
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=16, costs=costs))
    s.add(_req("a", prompt_len=64, max_tokens=2, shared=True))
    first = s.step()
    assert (first.prefix_queries, first.prefix_hits, first.cost_s) == (64, 0, 64.0)
    while s.has_work():
        s.step()
    assert s.kv_usage() == 0.0  # evictable cached blocks count as free
    s.add(_req("b", prompt_len=64, max_tokens=2, shared=True))
    second = s.step()
    # the last token is always computed: 3 of 4 blocks hit
    assert (second.prefix_queries, second.prefix_hits, second.cost_s) == (64, 48, 16.0)
    assert s.running[0].num_cached_tokens == 48
    while s.has_work():
        s.step()
        _assert_invariants(s)


def test_running_requests_share_their_common_prefix_blocks() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=101, block_size=16, max_num_batched_tokens=64))
    s.add(_req("a", prompt_len=64, max_tokens=50, shared=True))
    s.step()  # a's prompt is computed and its full blocks cached
    s.add(_req("b", prompt_len=64, max_tokens=50, shared=True))
    s.step()
    a, b = s.running
    assert a.block_ids[:3] == b.block_ids[:3]  # shared, counted once
    assert s.usable_blocks - s.free_blocks == len(set(a.block_ids) | set(b.block_ids))
    _assert_invariants(s)


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=9, block_size=4, max_model_len=32))
    s.add(_req("a", prompt_len=16, max_tokens=1, shared=True))
    while s.has_work():
        s.step()
    # another request needs every block: the cached prefix must make room
    s.add(_req("other", prompt_len=31, max_tokens=1))
    while s.has_work():
        s.step()
    s.add(_req("again", prompt_len=16, max_tokens=1, shared=True))
    assert s.step().prefix_hits == 0


def test_without_prefix_caching_nothing_is_shared_or_counted() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=100, enable_prefix_caching=False))
    for rid in ("a", "b"):
        s.add(_req(rid, prompt_len=64, max_tokens=2, shared=True))
        result = s.step()
        assert (result.prefix_queries, result.prefix_hits) == (0, 0)
        while s.has_work():
            s.step()
