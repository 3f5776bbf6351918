"""Adaptive KV admission: admit on what requests will probably use, corrected by the engine.

Owns, per replica, the decision "may this request go to this replica now, and if not why
and for how long", and the output-length estimates it rests on. Must not read the clock,
do I/O, or hold per-request state: the caller passes `now`, each new scrape, and the
sums of what is reserved (`Reservations`), so that those sums can later come from a
store shared by several gateways instead of this process alone.

Why. Reserving every request's prompt + `max_tokens` (`admission.kv_reservation_full`)
is exact when requests run to `max_tokens` and wasteful when they stop at EOS far
earlier, as real traffic does: it gave away 61% of the fleet's throughput to avoid 5
cheap preemptions. A few preemptions are normal; a storm (preempt, recompute, preempt
again) is what burns capacity. So this controller reserves on learned lengths, lets the
engine's own gauges say when that bet is going wrong, and tightens toward the worst case
only then.

Figures. Those below that compare one setting against another in the same run (paired
runs of bench_admission, "x% at A, y% at B") were measured before 28f56c3, when each mode
of a round drew its requests' lengths within a class from its own prompts; the variant's
slot met easier long generations in rounds 2 and 3 of every such run, whatever the
variant. They say which way a setting moved one sequence, not by how much; re-measure
before relying on one. With every mode meeting the same lengths, the defaults met every
goal of issue 17 in one full run (README).

What it takes from proven systems (read in their sources):
- vLLM 0.33's scheduler (`v1/core/sched/scheduler.py`, `kv_cache_manager.py`): a waiting
  request is admitted when its *current* sequence fits in free blocks, with no thought for
  its growth; when a running request needs a block and none is free, the newest running
  request is preempted and recomputed later, repeatedly. Its `watermark` (a share of
  blocks kept free when admitting, default 0) is the engine's own guard against that. The
  reservation here is a predictive watermark: the room requests in flight are expected to
  grow into. vLLM frees nothing until a request finishes, so the only safe moment to
  refuse is before admission.
- llm-d's saturation detector: a replica has no capacity when its waiting queue is over
  a threshold (5) or its KV usage over one (0.8), and metrics older than a staleness bound
  (200 ms, four refresh intervals) count as no capacity: fail closed. Its newer
  concurrency detector combines logical in-flight tokens with the measured KV by taking
  the larger, and falls back to the logical count when telemetry is stale. Taken: the
  queue threshold stays (`waiting_max`, before this module); measured KV and reservations
  are combined by the larger; metrics older than `metrics_max_age_s` hold the replica
  ("metrics stale", fail closed as llm-d), and between `fresh_s` and that bound the
  reservation drifts toward the worst case as the data ages (the logical count needs no
  telemetry to be safe for this gateway's own requests).
- Dynamo's `active_decode_blocks_threshold` (recipes use 0.85): a worker is busy when its
  active KV blocks, including the output blocks the router tracks as they grow, pass a
  share of its blocks; new requests get 529 only when every worker is busy. Taken:
  `kv_high` on the measured usage, extrapolated by its trend to the time the scrape is
  stale for, as the last line before the engine must preempt; refusal only when every
  replica refuses (the caller's fleet step).
- Envoy's adaptive-concurrency gradient and Netflix's concurrency-limits (Gradient2,
  Vegas, AIMD): a limit is found by feedback, not configured. Gradient2 cuts the limit by
  the ratio of long- to short-term latency (clamped to [0.5, 1]), smooths the change, and
  does not grow a limit that demand is not pressing against ("app limited"); Vegas
  estimates the queue as limit x (1 - minRTT/RTT); Envoy has to probe its minRTT by
  pinning concurrency low, which costs throughput each time. An engine exports the queue
  (`waiting`) and the resource (KV usage, preemptions) directly, so latency inference and
  minRTT probing are not needed. Taken: the feedback shape: tighten multiplicatively and
  at once on loss (preemptions over a budget, measured usage past what was reserved),
  loosen additively and only while the limit is what refuses work; and partitioned shares
  (a lower tier yields before a higher one, as Netflix's partitions, but never to zero).

The model. A request reserves prompt + an expected output length, learned per
model/tier/tenant and max_tokens class (`OutputLengths`: decayed mean and spread of
observed completion tokens; worst case until a key has `min_samples` (1), the first
ones shrunk toward max_tokens by `prior_samples` (0.5): a cold start that waited for more
held a fresh gateway at the worst case for seconds, shedding work the engines had room
for (bench_admission eos: 87-94% of no admission's tokens/s)). One number per
replica, the reserve level r in [min_reserve, 1], moves its reservations between bets:

    r = 1     prompt + max_tokens             worst case: never preempts (today's rule)
    r = 0     prompt + expected               the learned mean
    r < 0     prompt + expected - |r| spread  overcommit, only as far as lengths vary
                                              (off by default: min_reserve = 0)

Why the mean and not a high quantile: the cache is shared by N requests, and what must
fit is their sum, whose spread grows as sqrt(N) while a per-request p90 over-reserves by
N x (p90 - mean) (for EOS-sampled lengths a p90 reservation held 3 of the 7 requests the
cache takes on average). So each request reserves its mean, and the replica adds
`spread_z` standard deviations of the sum (sqrt of the summed variances) on top: with
the cache packed to the sum of means alone, it overflows about half the time. Heavy tails
(a few long generations among short chats) make the mean too low for the requests
actually in flight (long ones stay longer); the feedback below catches that from the
engine. With lengths that never vary (`ignore_eos`, or every
request hitting `max_tokens`) expected = max_tokens and spread = 0: the reservation is
exactly the worst case at every r, so a full-length workload is never overcommitted.

Feedback, on each new scrape:
- preemptions: their rate (decayed over `preemption_window_s`) over
  `preemption_budget_per_s` moves r `tighten_step` of the way to 1, at most once per
  `tighten_interval_s` (the preemptions right after a step were caused before it); past
  half the budget they stop loosening for `calm_s` (under it they are the normal few).
- outgrown: with the cache (extrapolated `lookahead_s` by its trend) at `outgrown_at` or
  more, KV measured in use over `overrun_ratio` x what is reserved at r means the
  estimates are wrong (a shift to longer outputs), not the ordinary spread of lengths:
  r jumps at once to where the reservations cover what is measured. `outgrown_at` (0.97)
  is past `kv_high` (0.95) on purpose: up to the near-full hold, usage over the estimates
  is the long tail that hold guards (a heavy-tailed mix keeps its long generations in
  flight while the learned mean is short, and runs the cache at 86-98% with only a few
  cheap preemptions); only a cache that keeps filling past the hold, with nothing new
  admitted, says the requests in flight are longer than learned. At 0.85 the rule fired
  in each of the five mix runs of bench_admission whose samples were read, and held short
  chats at half their worst case for seconds; over five paired rounds the mix made 94% of
  admission off's tokens/s at 0.85 (87-101% a round) and 99% at 0.97 (94-104%), and the
  shift still tightened before its first preemption. Re-measured like for like (after
  28f56c3; three rounds of mix and shift, one run): the mix made 98.6% of admission off's
  tokens/s at 0.85 and 97.2% at 0.97, the shift 97.9% and 97.6%; at 0.85 the shift
  tightened 1.1-1.2 s before its first preemption (0.5-0.6 s at 0.97), with a TTFT p99
  of 113 ms (58 ms). The paired runs' five points are not there: 0.97 stays on the
  reasoning above, not on a measured gain. With several gateways, this one's
  part of the usage is its share (`quota`) of it.
- progress: generated tokens per running request per second under `progress_floor` of
  its recent best while the cache is near full: steps spent recomputing or stalled. It
  stops loosening (as pressure) but does not tighten by itself: step times also vary with
  prefills and with the host, and a recompute storm shows in the preemption counter.
- near full: measured KV (extrapolated) over `kv_high` with requests waiting stops
  loosening (the admission check itself refuses, see below).
- calm: none of these for `calm_s`, and a request was refused for reservations in the
  last `calm_s` (the limit is binding, not app-limited): r falls by `loosen_per_s`
  (0.3 a second: from the worst case to the mean in about 3 s). Loosening is slow in
  Netflix's AIMD and Envoy's gradient because they find the limit by probing; here the
  engine's gauges catch an overcommit within a scrape (near full holds, outgrown jumps
  back), so a slow climb back only holds out work the engine has room for. In the mixed
  chats a start-up burst of preemptions left r at ~0.45 while the cache fell to 30-60%;
  at 0.1 a second the short chats were refused for 4-6 s more (87.9% of admission off's
  tokens/s over three rounds; 98.5% at 0.3 on the same sequences). The shift at 0.3:
  97.1% (97.0% at 0.1), 48 preemptions against 41 (69 without admission; 0.21 a second
  per replica, the alert fires at 0.5), and it still tightened before its first
  preemption in each round; EOS unchanged (99.0%). Re-measured like for like (after
  28f56c3; three rounds of mix and shift, one run): the mix 98.5% at 0.3 and 97.4% at
  0.1, the shift 97.8% and 95.8% (the same 42 preemptions; tightened 0.5-0.8 s before the
  first either way). 0.3 is the better side, by one or two points, not ten.

Admission, per request (`decide`):
1. metrics older than `metrics_max_age_s`: hold, "metrics stale".
2. reservations at r (aged toward 1 past `fresh_s`), this request included, over
   `kv_target` x the cache's blocks (times a `quota`: 1 alone; a share when a fleet leader
   splits the replica between gateways): hold, "reserved".
3. measured KV, extrapolated by its trend over the scrape's age (+ `hold_lookahead_s`,
   0 by default), at or over `kv_high` while this gateway has requests on the replica:
   hold, "near full". This is the long-tail guard: a request that outgrew its estimate
   costs nothing until the cache is near full, and then nothing new is added before the
   engine must preempt. It reads the gauge where it is now, not where its trend may take
   it: every running request grows by a block every 16 steps, so a busy cache always
   trends upward between completions, and the trend's positive part over a further 0.5 s
   (`lookahead_s`, which "outgrown" keeps: there it catches a shift early) held the mixed
   chats' caches at ~86-90%, refusing short chats the engine had room for: 94.5% and 95.4%
   of admission off's tokens/s in two paired runs of three rounds, against 98.3% with the
   hold looking at the scrape's age only (99.2% with no look-ahead anywhere, but then the
   shift tightened no earlier than its first preemption in two of three rounds; with it,
   0.5-0.9 s before). The shift and EOS workloads: 98.2% and 99.1% (99.7% and 98.6% before).
   Re-measured like for like (after 28f56c3; three rounds, mix and shift): 100.9% and
   98.8% at 0, 98.4% and 97.4% at 0.5.
   Not when, alone on the replica (`quota` 1), the requests in flight and this one all
   fit at their worst case (as the plain reserve rule, which ignores the gauge): then
   nothing can outgrow, and a gauge scraped before a request finished would hold its room
   until the next scrape (one lockstep full-length round: 820 tok/s against 788-800 with
   it).
   Opt-in (`hold_while_resuming`, off by default): after a preemption, while the engine's
   queue is not empty, hold too. vLLM resumes preempted requests before anything that
   arrives after them; their blocks freed, the gauge reads low and reservations have
   room, but a request admitted then waits behind them: in one full bench_admission run
   (on 88f224e), six mixed-chat requests admitted so waited 0.9-3.0 s for their first token
   (five of them in one round), which set the mix's TTFT p99 (935 ms against 100 without
   admission). One paired run with it on (mix, shift, EOS; three rounds): 95.8%, 98.0%
   and 100.0% of admission off's tokens/s (97.4%, 97.0% and 99.5% off), and the mix's
   slowest first token 769 ms on against 2,196 ms off (3,461 ms without admission): one
   request each way, too few to move a p99 of ~370 samples, so what it buys is not yet
   measured: off until it is. Like for like (after 28f56c3; three rounds of mix and shift,
   one run), on against off: the mix 97.3% against 98.8% of admission off's tokens/s,
   TTFT p99 52 ms against 56 (25 preemptions against 20); the shift 96.5% against 96.2%,
   TTFT p99 52 ms against 79 (53 against 49). A lower p99 for a point or so of tokens in
   the mix: still off, with this as the trade to weigh.
4. otherwise admit. A replica with nothing of ours in flight admits unless stale (the
   engine queues what does not fit; this gateway cannot make that worse), unless this
   gateway holds only a share of it (`quota` < 1): the others may fill the rest.
Tiers: a request of priority p (0 most important) yields `tier_step` x (p - top) of the
limit and of `kv_high` to the most important tier `top` with requests in flight on the
replica, so lower tiers are refused first as the cache fills; a tier with nothing in
flight on the replica is judged as the top tier, so no tier is starved to zero.

Retry-After (up to `max_retry_after_s`): the requests that must finish for this one to
fit (the blocks over the limit / the mean blocks per request in flight), divided by the
replica's decayed completion rate; None when nothing has completed yet (the caller falls
back to the fleet's drain estimate). How exact depends on the reservations it rests on:
- every request in flight and this one reserved at its worst case (lengths that never
  vary, a cold start, or the level at 1): the estimate itself, from
  `min_exact_retry_after_s` (0.1 s; `retry-after-ms`, which the OpenAI SDKs prefer,
  carries it, the `Retry-After` header rounds it up to whole seconds). Coming back early
  cannot make the engine preempt, and the room it is owed would stand idle meanwhile:
  rounded up to a second, lockstep full-length requests left both replicas empty for
  ~0.3 s after each batch (88.0% and 88.8% of their capacity's tokens/s in two paired
  runs; 94.6% and 97.5% unrounded).
- otherwise whole seconds, from `min_retry_after_s` (1 s): with lengths that vary the
  estimate is rough, and clients brought back sooner filled the cache sooner: on the same
  request sequences the mix made 773-957 tok/s a round unrounded, 950-1,026 in whole
  seconds, through the preemptions and tightening that followed.

Across gateways (issue 15). An engine's gauges see every gateway's requests; one
gateway's reservations see only its own. What a single gateway cannot know is the
others' reservations: `decide` takes this gateway's share of the replica, `quota`
(leader-issued: `policy.quota`), and holds its own reservations within that share, so
the gateways' reservations together stay within the limit, while near full and the
preemption rate keep judging the replica as a whole. `observe` takes the same share for
"outgrown": without it, the others' usage would read as this gateway's requests
outgrowing their estimates, and every gateway would sit at the worst case.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from seawall.policy.load import EngineLoad
from seawall.values import frozen

# ----------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class ControlConfig:
    kv_target: float = 1.0  # reservations may fill this share of the cache's blocks
    kv_high: float = 0.95  # measured usage at which the top tier stops being admitted
    tier_step: float = 0.05  # each lower tier in flight yields this share
    min_reserve: float = 0.0  # the loosest level; below 0 overcommits by the spread
    spread_z: float = 0.5  # standard deviations of the sum of lengths reserved on top
    # Half the storm alert's rate(vllm:num_preemptions_total[5m]) > 0.5.
    preemption_budget_per_s: float = 0.25
    preemption_window_s: float = 15.0
    tighten_step: float = 0.25  # share of the way to the worst case per step
    tighten_interval_s: float = 2.0  # at most one step per this long (its effect shows)
    loosen_per_s: float = 0.3  # from worst case to the mean in ~3 s
    calm_s: float = 2.0  # no loosening this soon after pressure
    outgrown_at: float = 0.97  # heading past the near-full hold: estimates are wrong
    overrun_ratio: float = 2.0  # usage over this x the reservations: estimates are wrong
    progress_floor: float = 0.5
    fresh_s: float = 2.0
    metrics_max_age_s: float = 5.0
    lookahead_s: float = 0.5
    hold_lookahead_s: float = 0.0  # near full reads the gauge over its age only (see 3.)
    hold_while_resuming: bool = False  # after a preemption, until the queue empties (3.)
    trend_tau_s: float = 1.0
    completion_window_s: float = 10.0
    min_retry_after_s: float = 1.0  # whole seconds where lengths vary
    min_exact_retry_after_s: float = 0.1  # where every reservation is the worst case
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.kv_target <= 2 or not 0 < self.kv_high <= 1:
            raise ValueError("kv_target must be in (0, 2] and kv_high in (0, 1]")
        if not -1 <= self.min_reserve <= 1:
            raise ValueError("min_reserve must be in [-1, 1]")
        if self.fresh_s >= self.metrics_max_age_s:
            raise ValueError("fresh_s must be below metrics_max_age_s")


# ----------------------------------------------------------------------------- lengths


@frozen
class LengthEstimate:
    expected_tokens: float
    spread_tokens: float  # standard deviation
    samples: int  # completions seen (the estimate weighs the recent ones most)


@dataclass(slots=True)
class _Moments:
    mean: float = 0.0
    var: float = 0.0
    count: int = 0


Key = tuple[str, str, str]  # (model, tier, tenant)


def length_class(max_tokens: int) -> str:
    """Requests are learned apart by the power of two their `max_tokens` rounds up to: a
    1-token probe and a 1,000-token generation from the same tenant are different
    populations, and one mean over both would describe neither."""
    bits = (max_tokens - 1).bit_length() if max_tokens > 1 else 0
    return _CLASS_NAMES[bits] if bits < len(_CLASS_NAMES) else f"<={1 << bits}"


_CLASS_NAMES = tuple(f"<={1 << bits}" for bits in range(64))  # asked for on every request


class OutputLengths:
    """Decayed mean and spread of completion tokens, per (model, tier, tenant) and
    `length_class(max_tokens)`, with (model, tier) and (model) of the same class as
    fallbacks while a key has too few samples (never another class: its lengths say nothing
    about this one's).

    Decay is per observation (`alpha`, about the last 2/alpha completions), not per
    second: a quiet tenant's estimate does not fade to nothing, and a busy one adapts as
    fast as its completions arrive. Keys are bounded (`max_keys`, least recently seen
    dropped); tenants come from the configuration, so the bound is rarely reached."""

    def __init__(
        self,
        alpha: float = 0.05,
        min_samples: int = 1,
        max_keys: int = 4096,
        prior_samples: float = 0.5,
    ):
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.min_samples = min_samples
        self.prior_samples = prior_samples
        self.max_keys = max_keys
        self._stats: OrderedDict[tuple[str, ...], _Moments] = OrderedDict()

    @staticmethod
    def _chain(key: Key, max_tokens: int) -> tuple[tuple[str, ...], ...]:
        model, tier, tenant = key
        c = length_class(max_tokens)
        return ((model, tier, tenant, c), (model, tier, c), (model, c))

    def observe(self, key: Key, max_tokens: int, completion_tokens: int) -> None:
        x = float(max(completion_tokens, 0))
        for k in self._chain(key, max_tokens):
            m = self._stats.get(k)
            if m is None:
                m = self._stats[k] = _Moments()
                if len(self._stats) > self.max_keys:
                    self._stats.popitem(last=False)
            else:
                self._stats.move_to_end(k)
            m.count += 1
            # Exponentially weighted mean and variance (West's incremental form); the
            # first samples weigh as a plain average until 1/alpha samples are in.
            a = max(self.alpha, 1.0 / m.count)
            d = x - m.mean
            m.mean += a * d
            m.var = (1 - a) * (m.var + a * d * d)

    def known(self) -> dict[str, LengthEstimate]:
        """Every key's estimate, named "model/tier/tenant/class" (coarser keys shorter)."""
        return {
            "/".join(k): LengthEstimate(m.mean, math.sqrt(m.var), m.count)
            for k, m in self._stats.items()
        }

    def estimate(self, key: Key, max_tokens: int) -> LengthEstimate | None:
        """The expected length of a request of this key with this `max_tokens`. The first
        completions of a key are its shortest ones (the long ones are still running), so
        the mean is shrunk toward `max_tokens` as if `prior_samples` requests had run to
        it: halfway after as many real ones, 5% after twenty times as many."""
        for k in self._chain(key, max_tokens):
            m = self._stats.get(k)
            if m is not None and m.count >= self.min_samples:
                w = self.prior_samples / (m.count + self.prior_samples)
                mean = m.mean + max(0.0, max_tokens - m.mean) * w
                return LengthEstimate(mean, math.sqrt(m.var), m.count)
        return None


# ----------------------------------------------------------------------------- demand


@frozen
class Demand:
    """What one request may use: tokens, before the replica's block size is known."""

    prompt_tokens: int
    max_tokens: int  # the output ceiling (already clamped to the model's context)
    expected_tokens: float  # learned mean output, <= max_tokens
    spread_tokens: float  # learned spread, <= expected_tokens
    priority: int = 0
    # `sized`'s last answer, (block size, answer): a pure function of the fields above,
    # asked for the same block size by every decision and reservation of the request.
    _sized: tuple[int, tuple[int, int, int, int]] | None = field(
        default=None, compare=False, repr=False
    )

    @staticmethod
    def of(
        prompt_tokens: int, max_tokens: int, estimate: LengthEstimate | None, priority: int = 0
    ) -> Demand:
        """No estimate yet (a cold start, a new tenant): the worst case, spread 0."""
        top = max(max_tokens, 0)
        if estimate is None:
            return Demand(prompt_tokens, top, float(top), 0.0, priority)
        expected = min(float(top), max(estimate.expected_tokens, 0.0))
        return Demand(prompt_tokens, top, expected, min(expected, estimate.spread_tokens), priority)

    def variance(self, block_size: int) -> int:
        """The spread squared, in blocks squared (hundredths: integer sums stay exact)."""
        return self.sized(block_size)[3]

    def blocks(self, block_size: int) -> tuple[int, int, int]:
        """Whole blocks (as the engine allocates) at the reserve levels 1, 0 and -1."""
        worst, expected, low, _ = self.sized(block_size)
        return worst, expected, low

    def sized(self, block_size: int) -> tuple[int, int, int, int]:
        """`blocks` and `variance` at once (the request path asks for both, per replica)."""
        memo = self._sized
        if memo is not None and memo[0] == block_size:
            return memo[1]
        b = block_size if block_size > 1 else 1
        p = self.prompt_tokens
        e = self.expected_tokens
        spread = self.spread_tokens
        answer = (
            _whole_blocks(p + self.max_tokens, b),
            _whole_blocks(p + e, b),
            _whole_blocks(p + e - spread, b),
            round((spread / b) ** 2 * 100),
        )
        object.__setattr__(self, "_sized", (block_size, answer))
        return answer


def _whole_blocks(tokens: float, block_size: int) -> int:
    n = math.ceil(tokens / block_size - 1e-9)
    return n if n > 0 else 0


@frozen
class Reservations:
    """The sums for one replica: everything `decide` needs, and nothing per request, so a
    shared store can hold them (five integer counters and a small per-priority count)."""

    requests: int = 0
    worst_blocks: int = 0  # at reserve level 1
    expected_blocks: int = 0  # at 0
    low_blocks: int = 0  # at -1
    by_priority: tuple[int, ...] = ()  # requests in flight per priority 0, 1, ...
    variance: int = 0  # sum of the spreads squared, hundredths of blocks squared

    def add(self, d: Demand, block_size: int, sign: int = 1) -> Reservations:
        worst, expected, low, variance = d.sized(block_size)
        p = d.priority if d.priority > 0 else 0
        counts = self.by_priority
        if sign > 0:
            # Adding only grows the sums: no clamping, and the common case (a priority
            # already counted) is one tuple rebuilt.
            if p < len(counts):
                counts = (*counts[:p], counts[p] + 1, *counts[p + 1 :])
            else:
                counts = (*counts, *(0,) * (p - len(counts)), 1)
            return Reservations(
                self.requests + 1,
                self.worst_blocks + worst,
                self.expected_blocks + expected,
                self.low_blocks + low,
                counts,
                self.variance + variance,
            )
        if p < len(counts) and counts[p] > 0 and self.requests > 0:
            # The common removal: a request that was added. The sums only shrink, and
            # stay at or above zero (clamped, so a double removal cannot go negative).
            if p == len(counts) - 1 and counts[p] == 1:
                shrunk = counts[:p]
                while shrunk and shrunk[-1] == 0:
                    shrunk = shrunk[:-1]
            else:
                shrunk = (*counts[:p], counts[p] - 1, *counts[p + 1 :])
            return Reservations(
                self.requests - 1,
                max(0, self.worst_blocks - worst),
                max(0, self.expected_blocks - expected),
                max(0, self.low_blocks - low),
                shrunk,
                max(0, self.variance - variance),
            )
        listed = list(counts)
        if len(listed) <= p:
            listed.extend([0] * (p + 1 - len(listed)))
        listed[p] = max(0, listed[p] + sign)
        while listed and listed[-1] == 0:
            listed.pop()
        return Reservations(
            max(0, self.requests + sign),
            max(0, self.worst_blocks + sign * worst),
            max(0, self.expected_blocks + sign * expected),
            max(0, self.low_blocks + sign * low),
            tuple(listed),
            max(0, self.variance + sign * variance),
        )

    def remove(self, d: Demand, block_size: int) -> Reservations:
        return self.add(d, block_size, sign=-1)

    def blocks_at(self, reserve: float) -> float:
        """Blocks reserved at a reserve level: linear between the exact endpoints."""
        return _at(reserve, self.worst_blocks, self.expected_blocks, self.low_blocks)

    def total_at(self, reserve: float, spread_z: float) -> float:
        """`blocks_at` plus `spread_z` standard deviations of the sum of the lengths in
        flight (sqrt of the summed variances), fading to none at the worst case, where
        nothing is left to chance."""
        return self.blocks_at(reserve) + _margin(reserve, spread_z, self.variance)

    def top_priority(self) -> int | None:
        return next((p for p, n in enumerate(self.by_priority) if n > 0), None)

    def count(self, priority: int) -> int:
        return self.by_priority[priority] if 0 <= priority < len(self.by_priority) else 0


# ----------------------------------------------------------------------------- decisions


class Cause(StrEnum):
    """Why the reserve level is where it is (a small set: it is a metric label)."""

    calm = "calm"
    loosening = "loosening"
    preemptions = "preemptions"
    outgrown = "outgrown"
    progress = "progress"
    near_full = "near_full"


class HoldKind(StrEnum):
    stale = "stale"
    reserved = "reserved"
    near_full = "near_full"


@frozen
class Admit:
    reserved_blocks: float  # this request included, at the reserve level used
    limit_blocks: float


@frozen
class Hold:
    kind: HoldKind
    reason: str
    retry_after_s: float | None  # None: no completions seen yet to estimate from


@dataclass(frozen=True, slots=True)
class ControlState:
    """What the admin API, the status page and the metric show for one replica."""

    reserve_level: float  # the level decisions use now (aged toward 1 if metrics are old)
    learned_level: float  # the level the feedback has reached
    cause: Cause
    why: str
    limit_blocks: float | None
    reserved_blocks: float
    capacity_blocks: float | None
    kv_usage: float | None
    kv_trend_per_s: float  # the usage's smoothed change per second (its share of the cache)
    preemption_rate_per_s: float
    completions_per_s: float
    metrics_age_s: float | None


# ----------------------------------------------------------------------------- controller


@dataclass(slots=True)
class _Scrape:
    at: float
    kv_usage: float | None
    preemptions_total: float | None
    generation_total: float | None
    running: float | None


@dataclass(slots=True)
class ReplicaAdmission:
    """The controller for one replica. Mutable, single-owner (the gateway's event loop);
    every method takes `now` and reads nothing else from the world."""

    config: ControlConfig = field(default_factory=ControlConfig)
    level: float = 0.0
    cause: Cause = Cause.calm
    why: str = "no pressure seen"
    _last: _Scrape | None = None
    _preempt_rate: float = 0.0  # decayed events / window
    _kv_slope: float = 0.0  # usage per second, smoothed
    _best_progress: float = 0.0  # tokens per running request per second, decayed max
    _pressure_at: float = -math.inf
    _tightened_at: float = -math.inf
    _refused_at: float = -math.inf
    _completion_rate: float = 0.0
    _completion_at: float | None = None
    _resuming: bool = False  # preempted requests may be waiting to resume

    # -- feedback --------------------------------------------------------------------

    def observe(
        self, load: EngineLoad, reserved: Reservations, now: float, quota: float = 1.0
    ) -> None:
        """Feed a scrape (call once per new `scraped_at`; older or equal ones are ignored).

        `reserved` is what this gateway has in flight on the replica, and `quota` its
        share of the replica (the engine's usage counts every gateway's requests: this
        gateway's part of it is judged against its own reservations)."""
        cfg = self.config
        cur = _Scrape(
            load.scraped_at,
            load.kv_usage,
            load.preemptions_total,
            load.generation_tokens_total,
            load.running,
        )
        prev = self._last
        if prev is not None and cur.at <= prev.at:
            return
        self._last = cur
        if prev is None:
            return
        dt = cur.at - prev.at
        decay = math.exp(-dt / cfg.preemption_window_s)
        preempted = 0.0
        if cur.preemptions_total is not None and prev.preemptions_total is not None:
            preempted = max(0.0, cur.preemptions_total - prev.preemptions_total)  # reset: 0
        self._preempt_rate = self._preempt_rate * decay + preempted / cfg.preemption_window_s
        if preempted > 0:
            self._resuming = True  # the preempted wait at the head of the engine's queue
        elif not load.waiting:
            self._resuming = False  # resumed (or the queue is not exported)
        if cur.kv_usage is not None and prev.kv_usage is not None:
            a = 1.0 - math.exp(-dt / cfg.trend_tau_s)
            self._kv_slope += a * ((cur.kv_usage - prev.kv_usage) / dt - self._kv_slope)
        progress = None
        if (
            cur.generation_total is not None
            and prev.generation_total is not None
            and cur.running
            and cur.generation_total >= prev.generation_total
        ):
            progress = (cur.generation_total - prev.generation_total) / dt / cur.running
            # A decayed maximum: the best recent progress, forgetting over a minute.
            self._best_progress = max(progress, self._best_progress * math.exp(-dt / 60.0))

        capacity = _capacity_blocks(load)
        kv = cur.kv_usage
        near_full = kv is not None and kv >= cfg.kv_high
        if preempted > 0 and self._preempt_rate > cfg.preemption_budget_per_s / 2:
            # Past half the budget, preemptions stop loosening; under it they are the normal
            # few, and holding the level for each one would only ratchet it up.
            self._pressure_at = now
        if preempted > 0 and self._preempt_rate > cfg.preemption_budget_per_s:
            self._toward_worst(now)
            self._set(
                Cause.preemptions,
                f"{self._preempt_rate:.2f} preemptions/s, over the budget of "
                f"{cfg.preemption_budget_per_s:g}/s",
            )
            return
        if (
            progress is not None
            and near_full
            and self._best_progress > 0
            and progress < cfg.progress_floor * self._best_progress
        ):
            # Not a step toward the worst case by itself: step times vary with prefills and
            # with the host, and a real recompute storm shows in the preemption counter.
            self._pressure_at = now
            self._set(
                Cause.progress,
                f"{progress:.1f} tokens/s per running request, under "
                f"{cfg.progress_floor:.0%} of the recent {self._best_progress:.1f} "
                "with the cache near full",
            )
            return
        if kv is not None and capacity and reserved.requests:
            # Outgrowing an estimate costs nothing while the cache has room; it matters once
            # the cache (a little ahead, by its trend) is filling.
            heading = kv + max(self._kv_slope, 0.0) * cfg.lookahead_s
            used = heading * capacity * min(max(quota, 0.0), 1.0)
            # An overcommit (r < 0) is a bet whose cost the preemption budget judges; what is
            # "outgrown" is usage past the learned estimates themselves.
            covered = reserved.total_at(max(self.level, 0.0), cfg.spread_z)
            if heading >= cfg.outgrown_at and used > covered * cfg.overrun_ratio:
                self.level = max(self.level, _level_covering(reserved, used))
                self._pressure_at = now
                self._set(
                    Cause.outgrown,
                    f"{used:.0f} KV blocks in use (and rising) with the cache at {kv:.0%}, "
                    f"over the {covered:.0f} reserved for the requests in flight",
                )
                return
        if near_full and (load.waiting or 0) > 0:
            self._pressure_at = now
            self._set(Cause.near_full, f"kv cache {kv:.0%} used with {load.waiting:g} waiting")
            return
        calm_for = now - self._pressure_at
        if calm_for < cfg.calm_s:
            return  # keep the level and the last cause until it has been calm a while
        # Loosen only while the limit refuses work (not app-limited) and there is room to
        # loosen into: with no estimates yet (a cold start) every level reserves the worst
        # case, and a level lowered then would overcommit the moment estimates arrive.
        room = (
            reserved.worst_blocks > reserved.expected_blocks
            if self.level > 0
            else (reserved.expected_blocks > reserved.low_blocks)
        )
        if now - self._refused_at <= cfg.calm_s and self.level > cfg.min_reserve and room:
            self.level = max(cfg.min_reserve, self.level - cfg.loosen_per_s * dt)
            since = "" if math.isinf(calm_for) else f" for {calm_for:.0f}s"
            self._set(Cause.loosening, f"calm{since}, and the limit is refusing work: loosening")
        elif self.cause is not Cause.calm:
            self._set(Cause.calm, "calm; the limit is not refusing work")

    def _toward_worst(self, now: float) -> None:
        # One multiplicative step per interval, as TCP cuts its window once per round trip:
        # the preemptions seen right after a step were caused before it.
        if now - self._tightened_at < self.config.tighten_interval_s:
            return
        self._tightened_at = now
        self.level = max(0.0, self.level) + (1.0 - max(0.0, self.level)) * self.config.tighten_step

    def _set(self, cause: Cause, why: str) -> None:
        self.cause, self.why = cause, why

    def completed(self, now: float) -> None:
        """A request on this replica finished (any outcome): the drain rate Retry-After uses."""
        window = self.config.completion_window_s
        if self._completion_at is not None:
            self._completion_rate *= math.exp(-max(now - self._completion_at, 0.0) / window)
        self._completion_rate += 1.0 / window
        self._completion_at = now

    def completions_per_s(self, now: float) -> float:
        if self._completion_at is None:
            return 0.0
        window = self.config.completion_window_s
        return self._completion_rate * math.exp(-max(now - self._completion_at, 0.0) / window)

    def preemption_rate_per_s(self) -> float:
        return self._preempt_rate

    # -- decision --------------------------------------------------------------------

    def effective_level(self, load: EngineLoad, now: float) -> float:
        """The learned level, aged toward the worst case as the metrics grow old."""
        cfg = self.config
        age = now - load.scraped_at
        if age <= cfg.fresh_s:
            return self.level
        aged = min(1.0, (age - cfg.fresh_s) / (cfg.metrics_max_age_s - cfg.fresh_s))
        return max(self.level, aged)

    def decide(
        self,
        demand: Demand,
        reserved: Reservations,
        load: EngineLoad,
        now: float,
        quota: float = 1.0,
    ) -> Admit | Hold:
        """May `demand` go to this replica now? `reserved` excludes it."""
        cfg = self.config
        age = now - load.scraped_at
        if age > cfg.metrics_max_age_s:
            return Hold(HoldKind.stale, "metrics stale", self._retry_after(1.0, now, False))
        capacity = _capacity_blocks(load)
        level = self.effective_level(load, now)
        # The request's own blocks added to the sums (no new Reservations: this runs for
        # every candidate replica of every request).
        block = load.kv_block_size or 16
        worst, expected, low, own_var = demand.sized(block)
        own = _at(level, worst, expected, low)
        wanted = (
            reserved.blocks_at(level)
            + own
            + _margin(level, cfg.spread_z, reserved.variance + own_var)
        )
        if capacity is None:
            return Admit(wanted, math.inf)
        p = demand.priority if demand.priority > 0 else 0
        # A tier with nothing in flight here is judged as the top one: never starved.
        counts = reserved.by_priority
        yields = 0
        if p < len(counts) and counts[p]:
            top = reserved.top_priority()
            if top is not None and p > top:
                yields = p - top
        share = max(0.0, 1.0 - cfg.tier_step * yields)
        quota = min(max(quota, 0.0), 1.0)
        limit = capacity * cfg.kv_target * share * quota
        if reserved.requests == 0 and quota >= 1.0:
            return Admit(wanted, limit)  # alone: the engine queues what does not fit
        if wanted > limit:
            self._refused_at = now
            # How many of those in flight (of average size) must finish for this one to fit.
            n = reserved.requests
            base, var = reserved.blocks_at(level), reserved.variance
            k = next(
                (
                    k
                    for k in range(1, n + 1)
                    if base * (n - k) / n
                    + own
                    + _margin(level, cfg.spread_z, var * (n - k) / n + own_var)
                    <= limit
                ),
                n,
            )
            of = "" if quota >= 1.0 else f" of this gateway's {quota:.0%} share"
            return Hold(
                HoldKind.reserved,
                f"{wanted:.0f} KV blocks would be reserved at reserve level {level:+.2f}, "
                f"over the {limit:.0f}{of} this replica gives priority {p}",
                self._retry_after(
                    k,
                    now,
                    level >= 1.0
                    or (reserved.worst_blocks == reserved.expected_blocks and worst == expected),
                ),
            )
        if cfg.hold_while_resuming and self._resuming and load.waiting:
            # The engine resumes its preempted requests before anything that arrives after
            # them: a request admitted now would wait behind them (opt-in, see 3.).
            return Hold(
                HoldKind.near_full,
                f"{load.waiting:g} requests waiting after a preemption: the engine resumes "
                "them first",
                self._retry_after(load.waiting, now, False),
            )
        kv = load.kv_usage
        if kv is not None and (quota < 1.0 or reserved.worst_blocks + worst > limit):
            # Near full guards the long tail; with every request in flight at its worst case
            # the cache holds them all, the engine cannot have to preempt, and the gauge adds
            # only its lag (a request finished since the scrape still reads as used). Not
            # with a share of the replica: the other gateways' requests may outgrow theirs.
            predicted = kv + max(self._kv_slope, 0.0) * (max(age, 0.0) + cfg.hold_lookahead_s)
            high = cfg.kv_high - cfg.tier_step * yields
            if predicted >= high:
                used_per_request = kv * capacity / max(load.running or reserved.requests, 1)
                over_blocks = (predicted - high) * capacity + low
                return Hold(
                    HoldKind.near_full,
                    f"kv cache {kv:.0%} used, heading for {predicted:.0%}: at or over the "
                    f"{high:.0%} where priority {p} stops",
                    self._retry_after(
                        over_blocks / used_per_request if used_per_request > 0 else 1.0,
                        now,
                        False,
                    ),
                )
        return Admit(wanted, limit)

    def _retry_after(self, requests_to_finish: float, now: float, exact: bool) -> float | None:
        rate = self.completions_per_s(now)
        if not rate > 0:
            return None
        cfg = self.config
        seconds = max(requests_to_finish, 1.0) / rate
        if exact:
            return min(cfg.max_retry_after_s, max(cfg.min_exact_retry_after_s, seconds))
        whole = float(math.ceil(seconds))
        return min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, whole))

    def state(self, reserved: Reservations, load: EngineLoad | None, now: float) -> ControlState:
        cfg = self.config
        capacity = _capacity_blocks(load) if load is not None else None
        level = self.effective_level(load, now) if load is not None else self.level
        limit = capacity * cfg.kv_target if capacity is not None else None
        return ControlState(
            reserve_level=level,
            learned_level=self.level,
            cause=self.cause,
            why=self.why,
            limit_blocks=limit,
            reserved_blocks=reserved.total_at(level, cfg.spread_z),
            capacity_blocks=capacity,
            kv_usage=load.kv_usage if load is not None else None,
            kv_trend_per_s=self._kv_slope,
            preemption_rate_per_s=self._preempt_rate,
            completions_per_s=self.completions_per_s(now),
            metrics_age_s=(now - load.scraped_at) if load is not None else None,
        )


def _margin(reserve: float, spread_z: float, variance: float) -> float:
    if not variance:
        return 0.0
    return spread_z * math.sqrt(variance / 100) * (1.0 - min(max(reserve, 0.0), 1.0))


def _at(reserve: float, worst: float, expected: float, low: float) -> float:
    if reserve >= 0:
        return expected + min(reserve, 1.0) * (worst - expected)
    return expected + max(reserve, -1.0) * (expected - low)


def _capacity_blocks(load: EngineLoad | None) -> float | None:
    if load is None or not load.kv_capacity_tokens:
        return None
    return load.kv_capacity_tokens / max(load.kv_block_size or 16, 1)


def _level_covering(reserved: Reservations, used_blocks: float) -> float:
    """The reserve level at which the reservations cover `used_blocks` (at most 1)."""
    span = reserved.worst_blocks - reserved.expected_blocks
    if span <= 0:
        return 1.0
    return min(1.0, (used_blocks - reserved.expected_blocks) / span)
