"""Structured output's per-step grammar cost in the emulator's scheduler core (issue 11,
item 11): a constrained request's bitmask work overlaps the forward pass of every step it
samples in, so a heavy grammar sets those steps' length for every sequence sharing them;
a light one hides, and an unconstrained batch pays nothing."""

from __future__ import annotations

import pytest

from seawall.sim import textgen
from seawall.sim.openai import grammar_cost
from seawall.sim.scheduler import (
    Scheduler,
    SchedulerConfig,
    SimRequest,
    StepCosts,
    grammar_step_cost_s,
    schema_shape,
)

PER_NODE_S = 2e-6


def nested(depth: int, width: int) -> dict[str, object]:
    """A schema `depth` objects deep with `width` string properties at each level."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth):
        schema = {
            "type": "object",
            "properties": {f"p{i}": schema for i in range(width)},
        }
    return schema


def test_schema_shape_counts_nodes_and_nesting() -> None:
    assert schema_shape({"type": "string"}) == (2, 2)
    assert schema_shape("x") == (1, 1)
    assert schema_shape({"type": "object", "properties": {"a": {"type": "integer"}}}) == (5, 4)
    assert schema_shape({"enum": ["a", "b", "c"]}) == (5, 3)


def test_grammar_cost_grows_with_size_and_depth() -> None:
    small = grammar_step_cost_s(*schema_shape(nested(1, 3)), PER_NODE_S)
    wide = grammar_step_cost_s(*schema_shape(nested(1, 30)), PER_NODE_S)
    deep = grammar_step_cost_s(*schema_shape(nested(6, 3)), PER_NODE_S)
    assert 0 < small < wide
    assert small < deep
    assert grammar_step_cost_s(0, 0, PER_NODE_S) == 0.0
    assert grammar_step_cost_s(100, 5, 0.0) == 0.0  # --grammar-per-node-us 0: off
    # the documented scale: a 2,000-node, depth-10 schema adds 40 ms to each step
    assert grammar_step_cost_s(2000, 10, PER_NODE_S) == pytest.approx(0.040)


def test_constraint_is_read_from_response_format_and_structured_outputs_only() -> None:
    schema = nested(3, 4)
    expected = grammar_step_cost_s(*schema_shape(schema), PER_NODE_S)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert grammar_cost(rf, None, PER_NODE_S) == pytest.approx(expected)
    assert grammar_cost(None, {"json": schema}, PER_NODE_S) == pytest.approx(expected)
    assert grammar_cost({"type": "json_object"}, None, PER_NODE_S) > 0
    assert grammar_cost(None, {"regex": "(a|b)+[0-9]{3}"}, PER_NODE_S) > 0
    assert grammar_cost(None, {"choice": ["yes", "no"]}, PER_NODE_S) > 0
    assert grammar_cost({"type": "text"}, None, PER_NODE_S) == 0.0
    assert grammar_cost(None, None, PER_NODE_S) == 0.0
    # `guided_json` is not an argument at all: vLLM 0.33 ignores the removed guided_*
    # fields, and the server never looks at them


def _req(rid: str, prompt_len: int, grammar_s: float = 0.0) -> SimRequest:
    return SimRequest(
        request_id=rid,
        prompt_ids=[textgen.WORD_BASE + (i % 400) for i in range(prompt_len)],
        max_tokens=50,
        key=3,
        ignore_eos=True,
        grammar_cost_s=grammar_s,
    )


def test_a_constrained_sequence_slows_every_step_it_samples_in() -> None:
    costs = StepCosts(base_s=0.010, per_seq_s=0.0, per_prefill_token_s=0.0)
    grammar_s = 0.040
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, costs=costs))
    sched.add(_req("plain", 8))
    plain_alone = sched.step()  # prefill + first token of the plain stream
    assert plain_alone.cost_s == pytest.approx(0.010)

    # a constrained request with a long prompt: its prefill chunks sample nothing, so
    # they add no grammar work; once it decodes, every shared step pays for its bitmask
    sched.add(_req("heavy", 200, grammar_s))
    seen: list[tuple[bool, float]] = []
    for _ in range(8):
        result = sched.step()
        sampled = {r.request_id for r, _ in result.outputs}
        assert "plain" in sampled  # the plain stream decodes in every one of these steps
        seen.append(("heavy" in sampled, result.cost_s))
    assert [cost for heavy, cost in seen if not heavy] == pytest.approx(
        [0.010] * sum(1 for heavy, _ in seen if not heavy)
    )
    heavy_costs = [cost for heavy, cost in seen if heavy]
    # the bitmask outlasts the forward pass: the step takes the grammar's time
    assert heavy_costs and heavy_costs == pytest.approx([grammar_s] * len(heavy_costs))
    assert seen[0][0] is False  # the first shared step was the heavy one's prefill chunk

    sched.abort("heavy")
    assert sched.step().cost_s == pytest.approx(0.010)  # gone with it


def test_constrained_sequences_add_up_and_a_light_grammar_hides() -> None:
    costs = StepCosts(base_s=0.001, per_seq_s=0.0, per_prefill_token_s=0.0)
    sched = Scheduler(SchedulerConfig(costs=costs))
    sched.add(_req("a", 4, 0.003))
    sched.add(_req("b", 4, 0.005))
    assert sched.step().cost_s == pytest.approx(0.008)  # the batch's bitmasks, one fill

    light = Scheduler(SchedulerConfig(costs=StepCosts(base_s=0.010, per_seq_s=0.0,
                                                      per_prefill_token_s=0.0)))  # fmt: skip
    light.add(_req("small-schema", 4, 0.0001))
    assert light.step().cost_s == pytest.approx(0.010)  # behind the forward pass
