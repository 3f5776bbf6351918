"""vLLM 0.33's Prometheus families, exactly: names, types, label names, HELP, buckets.

Owns: the emulator's own `CollectorRegistry` (with the process, platform and gc
collectors, as a real single-server scrape has them) and the families in it, with every
label child created at startup as vLLM does. The engine loop feeds it; `render()` gives
the `/metrics` body.

How vLLM 0.33.0 answers a scrape (measured with its own wiring, prometheus_client
0.26.0 and prometheus-fastapi-instrumentator 8.1.0; docs/engines-reference.md §1.1):
- `GET /metrics` is prometheus-fastapi-instrumentator's route, registered before
  prometheus_client's ASGI app is mounted at `/metrics`, so it wins: the text format
  whatever `Accept` says, names as declared (`vllm:...`), and the client's
  `CONTENT_TYPE_LATEST`. `render()` and `TEXT_CONTENT_TYPE` give that answer.
- `GET /metrics/` (and any `/metrics/<path>`) reaches the mounted ASGI app, which
  negotiates on `Accept` as every prometheus_client exporter does (`make_asgi_app`,
  `start_http_server`). OpenMetrics without an `escaping=` parameter, which Prometheus
  2.x asks for, rewrites sample names to `vllm_...` while `# TYPE` keeps `vllm:`;
  `escaping=allow-utf-8` (Prometheus 3.x) keeps them. `render_negotiated()` gives that
  answer, with the library's own negotiation and its gzip.

Must not: decide anything. Values come from the scheduler and the engine loop.
"""

from __future__ import annotations

import gzip

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

# prometheus_client's CONTENT_TYPE_LATEST since 0.23; vLLM 0.33 installs 0.26.
TEXT_CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"

# vllm/v1/metrics/buckets.py
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class SimMetrics:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        block_size: int,
        num_gpu_blocks: int,
        compat: bool = False,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
        labels = ["model_name", "engine"]
        values = {"model_name": model_name, "engine": "0"}
        self.compat = compat

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        def hist(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        mfu = "(for Model Flops Utilization calculations)."
        for name, what in (
            ("flops", "floating point operations"),
            ("read_bytes", "bytes read from memory"),
            ("write_bytes", "bytes written to memory"),
        ):
            counter(
                f"vllm:estimated_{name}_per_gpu", f"Estimated number of {what} per GPU {mfu}"
            ).labels(**values)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        ).labels(**values)
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        ).labels(**values)
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*labels, "reason"],
            registry=reg,
        )
        self.waiting_capacity = by_reason.labels(**values, reason="capacity")
        by_reason.labels(**values, reason="deferred")
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            [*labels, "sleep_state"],
            registry=reg,
        )
        sleep.labels(**values, sleep_state="awake").set(1)
        sleep.labels(**values, sleep_state="weights_offloaded")
        sleep.labels(**values, sleep_state="discard_all")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        ).labels(**values)
        self.gpu_cache_usage = (
            gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage."
                "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            ).labels(**values)
            if compat
            else None
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        ).labels(**values)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**values)
        counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.",
        ).labels(**values)
        counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.",
        ).labels(**values)
        counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
        ).labels(**values)
        counter(
            "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."
        ).labels(**values)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(**values)
        self.prompt_tokens = counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        ).labels(**values)
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*labels, "source"],
            registry=reg,
        )
        self.prompt_tokens_local_compute = by_source.labels(**values, source="local_compute")
        self.prompt_tokens_local_cache_hit = by_source.labels(**values, source="local_cache_hit")
        by_source.labels(**values, source="external_kv_transfer")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(**values)
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            [*labels, "source"],
            registry=reg,
        )
        self.prompt_tokens_cached_device = cached_by_source.labels(**values, source="device")
        for source in ("host", "p2p", "disk", "external_unspecified"):
            cached_by_source.labels(**values, source=source)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**values)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.success = {r: success.labels(**values, finished_reason=r) for r in FINISHED_REASONS}
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=reg,
        )
        self.admission_rejections = {
            reason: rejections.labels(model_name=model_name, reason=reason)
            for reason in ("max_num_queued_reqs", "max_num_queued_tokens")
        }

        request_tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", request_tokens
        ).labels(**values)
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            request_tokens,
        ).labels(**values)
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        ).labels(**values)
        self.request_max_num_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            request_tokens,
        ).labels(**values)
        self.request_params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        ).labels(**values)
        self.request_params_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            request_tokens,
        ).labels(**values)
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        ).labels(**values)
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ).labels(**values)
        self.tpot_compat = (
            hist(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds."
                "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                ITL_BUCKETS,
            ).labels(**values)
            if compat
            else None
        )
        self.request_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        ).labels(**values)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**values)
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**values)
        self.inference_time = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**values)
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**values)
        self.decode_time = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(**values)
        self.request_num_preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            NUM_PREEMPTIONS_BUCKETS,
        ).labels(**values)
        self.request_prefill_kv_computed_tokens = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            request_tokens,
        ).labels(**values)
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "gpu_memory_utilization",
                "num_cpu_blocks",
                "num_gpu_blocks",
            ],
            registry=reg,
        )
        cache_info.labels(
            block_size=str(block_size),
            cache_dtype="auto",
            enable_prefix_caching=str(enable_prefix_caching),
            engine="0",
            gpu_memory_utilization="0.9",
            num_cpu_blocks="None",
            num_gpu_blocks=str(num_gpu_blocks),
        ).set(1)

    def set_gauges(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.waiting_capacity.set(num_waiting)
        self.kv_usage.set(kv_usage)
        if self.gpu_cache_usage is not None:
            self.gpu_cache_usage.set(kv_usage)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        if self.tpot_compat is not None:
            self.tpot_compat.observe(seconds)

    def render(self) -> bytes:
        """vLLM's `GET /metrics`: the text format, Accept ignored (`TEXT_CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def render_negotiated(
        self, accept: str, accept_encoding: str = ""
    ) -> tuple[bytes, dict[str, str]]:
        """vLLM's `GET /metrics/`: prometheus_client's ASGI app. Body and headers."""
        encoder, content_type = choose_encoder(accept)
        body = encoder(self.registry)
        headers = {"Content-Type": content_type}
        if gzip_accepted(accept_encoding):
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"
        return body, headers
