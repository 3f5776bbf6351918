"""A small model of vLLM V1's scheduler: continuous batching over a paged KV cache.

Owns: the waiting and running queues, the block pool (counted, not addressed), chunked
prefill, recompute preemption, token sampling through `textgen`, finishing by EOS or
length, and the cost in seconds of each step. Pure: no I/O, no asyncio, no clock. The
server calls `step()`, sleeps `StepResult.cost_s`, then delivers what the step produced.

Must not: know about HTTP, metrics or time of day. Times for metrics are taken by the
caller around each step.

What it keeps from vLLM 0.33 (`v1/core/sched/scheduler.py`, reference §3):
- RUNNING requests are scheduled first; each needs slots for its next token or next
  prefill chunk. When the pool cannot give a block, the newest running request is
  preempted (fcfs: `running[-1]`), repeatedly, until the allocation fits or the request
  preempts itself. Preemption frees every block, resets the computed tokens to 0, keeps
  the output so far, and puts the request at the FRONT of the waiting queue.
- WAITING requests are admitted in order while the token budget lasts, the running set is
  under `max_num_seqs`, and the whole current sequence fits in free blocks; the first one
  that does not fit stops admission. No admission in a step that preempted.
- KV usage is `1 - free / (num_blocks - 1)`: one block is vLLM's null block and is never
  handed out.
- Structured output (a JSON schema, regex, choice or grammar) costs every step in which the
  constrained request samples: vLLM's `EngineCore.step` launches the forward pass, fills the
  batch's grammar bitmask (`Scheduler.get_grammar_bitmask`) meanwhile, and samples only when
  both are done. A light grammar hides behind the forward pass; a heavy one sets the step's
  length, so every sequence sharing its steps slows. `grammar_step_cost_s` is that work.
- With prefix caching (vLLM's default), a request admitted from the waiting queue reuses the
  cached blocks of its longest cached prefix (never its last token, which must be computed),
  and those tokens are neither computed nor charged to the step; the pool is `blocks`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from seawall.sim import textgen
from seawall.sim.blocks import BlockPool, chain_hash


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What one engine step costs, in seconds, as a function of the batch."""

    base_s: float = 0.010
    per_seq_s: float = 0.0001
    per_prefill_token_s: float = 0.00005

    def cost_s(self, num_seqs: int, num_prefill_tokens: int, grammar_s: float = 0.0) -> float:
        """The forward pass, or the grammar bitmask filled meanwhile if that takes longer
        (sampling waits for both)."""
        if num_seqs == 0:
            return 0.0
        forward_s = (
            self.base_s + self.per_seq_s * num_seqs + self.per_prefill_token_s * num_prefill_tokens
        )
        return max(forward_s, grammar_s)


def schema_shape(schema: object) -> tuple[int, int]:
    """(nodes, depth) of a JSON value: every object, array and scalar is a node; depth is
    the deepest nesting of objects and arrays (a scalar alone is depth 1)."""
    nodes = 0
    depth = 0
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:
        value, level = stack.pop()
        nodes += 1
        depth = max(depth, level)
        if isinstance(value, dict):
            stack.extend((v, level + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, level + 1) for v in value)
    return nodes, depth


def grammar_step_cost_s(nodes: int, depth: int, per_node_s: float) -> float:
    """What one constrained sequence adds to every step it samples in.

    The matcher advances its grammar state and fills the token bitmask each step; the work
    grows with the grammar (one rule per schema node) and with nesting (the stack of
    partial rules the matcher carries), so it is modelled as `nodes * depth * per_node_s`.
    With the default 2 us, a 20-node, depth-3 schema costs 0.12 ms, hidden behind a ~10 ms
    forward pass; a 2,000-node, depth-10 schema costs 40 ms, so its steps take 40 ms and
    every co-scheduled stream slows ~4x.
    """
    if nodes <= 0 or per_node_s <= 0:
        return 0.0
    return per_node_s * nodes * max(1, depth)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    num_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    costs: StepCosts = field(default_factory=StepCosts)
    gen: textgen.GenConfig = textgen.DEFAULT_GEN

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (one is the null block)")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True, eq=False)
class SimRequest:
    """One sequence. `key` decides its tokens with the context (see `textgen`)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    key: int
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    # per-step cost of its grammar (`grammar_step_cost_s`), 0 when unconstrained
    grammar_cost_s: float = 0.0
    # state below is the scheduler's
    stop_reason: int | None = None  # the stop token id that ended it
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, in order
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    context_hash: int = 0
    ever_scheduled: bool = False
    ever_decoded: bool = False

    def __post_init__(self) -> None:
        self.context_hash = textgen.hash_tokens(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did. `outputs` pairs each request with the token it produced."""

    outputs: list[tuple[SimRequest, int]]
    finished: list[SimRequest]
    preempted: list[SimRequest]
    first_scheduled: list[SimRequest]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_seqs: int
    cost_s: float
    prefix_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_hits: int = 0  # of those, tokens found

    @property
    def idle(self) -> bool:
        return self.num_scheduled_seqs == 0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks - 1)  # the null block is never allocated
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.num_preemptions_total = 0

    # ------------------------------------------------------------------ observation

    @property
    def usable_blocks(self) -> int:
        return self.config.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Free blocks, evictable cached ones included, as vLLM counts them."""
        return self.pool.num_free

    def kv_usage(self) -> float:
        return 1.0 - self.pool.num_free / self.usable_blocks

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    # ------------------------------------------------------------------ commands

    def add(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> SimRequest | None:
        """Remove a request now and free its blocks; None when it is already gone."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, FinishReason.ABORT)
        return request

    def finish(self, request_id: str, reason: FinishReason) -> SimRequest | None:
        """End a request for a reason found outside the core (a stop string, an error)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, reason)
        return request

    def abort_all(self) -> list[SimRequest]:
        gone = list(self.running) + list(self.waiting)
        for request in gone:
            self._finish(request, FinishReason.ABORT)
        return gone

    # ------------------------------------------------------------------ the step

    def step(self) -> StepResult:
        cfg = self.config
        token_budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        preempted: list[SimRequest] = []
        first_scheduled: list[SimRequest] = []

        # 1. running requests first, in order; preempt the newest when blocks run out
        pool = self.pool
        bs = cfg.block_size
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = min(
                len(request.prompt_ids) + len(request.output_ids) - request.num_computed,
                token_budget,
            )
            if num_new <= 0:
                index += 1
                continue
            need = -(-(request.num_computed + num_new) // bs) - len(request.block_ids)
            self_preempted = False
            while need > 0 and need > pool.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    self_preempted = True
                    break
            if self_preempted:
                break
            self._take(request, need)
            scheduled.append((request, num_new))
            token_budget -= num_new
            index += 1

        # 2. waiting requests, only when nothing was preempted in this step
        prefix_queries = 0
        prefix_hits = 0
        if not preempted:
            while self.waiting and token_budget > 0 and len(self.running) < cfg.max_num_seqs:
                request = self.waiting[0]
                hits = self._cache_hits(request)
                # the whole current sequence must fit, though only the chunk is allocated;
                # a hit on an evictable block takes that block out of the free count
                need_total = (
                    self.blocks_needed(request.num_tokens)
                    - len(hits)
                    + self.pool.num_evictable(hits)
                )
                if need_total > self.pool.num_free:
                    break
                if cfg.enable_prefix_caching and request.num_computed == 0:
                    prefix_queries += request.num_tokens
                    prefix_hits += len(hits) * cfg.block_size
                    if hits:
                        self.pool.touch(hits)
                        request.block_ids = list(hits)
                        request.num_computed = len(hits) * cfg.block_size
                    if not request.ever_scheduled:
                        request.num_cached_tokens = request.num_computed
                num_new = min(request.num_tokens - request.num_computed, token_budget)
                need = self.blocks_needed(request.num_computed + num_new) - request.num_blocks
                self.waiting.popleft()
                self._take(request, need)
                request.status = Status.RUNNING
                self.running.append(request)
                if not request.ever_scheduled:
                    request.ever_scheduled = True
                    first_scheduled.append(request)
                scheduled.append((request, num_new))
                token_budget -= num_new

        # 3. "execute": advance computed tokens, sample where a sequence is complete
        outputs: list[tuple[SimRequest, int]] = []
        finished: list[SimRequest] = []
        num_prefill = 0
        num_decode = 0
        grammar_s = 0.0
        max_len = cfg.max_model_len
        gen = cfg.gen
        caching = cfg.enable_prefix_caching
        for request, num_new in scheduled:
            # a recompute after preemption is prefill work too, output tokens included
            is_decode = num_new == 1 and request.num_output > 0 and request.ever_decoded
            if not is_decode:
                num_prefill += num_new
            request.num_computed += num_new
            if caching and request.num_computed // bs > request.num_registered:
                self._register_full_blocks(request)
            if request.num_computed < len(request.prompt_ids) + len(request.output_ids):
                continue  # a prefill chunk: no token yet
            grammar_s += request.grammar_cost_s  # its bitmask is filled before sampling
            token = textgen.next_token(request.key, request.context_hash, gen)
            request.output_ids.append(token)
            request.context_hash = textgen.extend_hash(request.context_hash, token)
            num_decode += 1
            request.ever_decoded = True
            outputs.append((request, token))
            if token == textgen.EOS_ID and not request.ignore_eos:
                reason: FinishReason | None = FinishReason.STOP
            elif token in request.stop_token_ids:
                # vLLM's check_stop: a stop token ends the request and is its stop_reason
                reason = FinishReason.STOP
                request.stop_reason = token
            elif request.num_output >= request.max_tokens or request.num_tokens >= max_len:
                reason = FinishReason.LENGTH
            else:
                reason = None
            if reason is not None:
                self._finish(request, reason)
                finished.append(request)

        cost_s = cfg.costs.cost_s(len(scheduled), num_prefill, grammar_s)
        return StepResult(
            outputs=outputs,
            finished=finished,
            preempted=preempted,
            first_scheduled=first_scheduled,
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_scheduled_seqs=len(scheduled),
            cost_s=cost_s,
            prefix_queries=prefix_queries,
            prefix_hits=prefix_hits,
        )

    # ------------------------------------------------------------------ internals

    def _cache_hits(self, request: SimRequest) -> list[int]:
        """Cached blocks for the request's longest cached prefix (admission only)."""
        if not self.config.enable_prefix_caching or request.num_computed > 0:
            return []
        # the last token is always computed, so at most (num_tokens - 1) tokens can hit
        full = (request.num_tokens - 1) // self.config.block_size
        self._ensure_hashes(request, full)
        return self.pool.lookup(request.block_hashes[:full])

    def _ensure_hashes(self, request: SimRequest, num_full_blocks: int) -> None:
        bs = self.config.block_size
        hashes = request.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            hashes.append(chain_hash(parent, request.tokens(i * bs, (i + 1) * bs)))

    def _register_full_blocks(self, request: SimRequest) -> None:
        full = min(request.num_computed // self.config.block_size, len(request.block_ids))
        if full <= request.num_registered:
            return
        self._ensure_hashes(request, full)
        for i in range(request.num_registered, full):
            self.pool.cache(request.block_ids[i], request.block_hashes[i])
        request.num_registered = full

    def _take(self, request: SimRequest, num_blocks: int) -> None:
        if num_blocks > 0:
            request.block_ids.extend(self.pool.allocate(num_blocks))

    def _release(self, request: SimRequest) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_registered = 0

    def _preempt(self, request: SimRequest) -> None:
        self._release(request)
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = Status.PREEMPTED
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _finish(self, request: SimRequest, reason: FinishReason) -> None:
        if request.status is Status.FINISHED:
            return
        if request.status is Status.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]


def total_held_blocks(requests: Iterable[SimRequest]) -> int:
    return sum(r.num_blocks for r in requests)
