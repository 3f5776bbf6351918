"""`seawall engine-args --config FILE`: the vLLM flags that back the gateway's limits up.

The gateway refuses oversized requests at the door, but a limit held in one place only
is one bug away from an engine stall. These flags make the engine refuse the same
requests itself: `--max-model-len` holds every tier's prompt + output, `--max-num-seqs`
caps the batch at what admission lets through per replica.
"""

from __future__ import annotations

import argparse
import logging
import sys

from seawall.config import ConfigError, GatewayConfig, load_config

log = logging.getLogger("seawall.gateway")


def tier_context_need(config: GatewayConfig) -> dict[str, int | None]:
    """Per tier, prompt + output tokens a request may need (None: unbounded prompt)."""
    tiers, tenants = config.tiers, config.tenants
    # Only tiers that some tenant uses (an open gateway uses the default tier).
    in_use = {t.tier for t in tenants.values()} if tenants else {"default"}
    need: dict[str, int | None] = {}
    for name, t in tiers.items():
        if name not in in_use:
            continue
        output = t.max_tokens if t.max_tokens is not None else t.max_tokens_default
        need[name] = None if t.max_prompt_tokens is None else t.max_prompt_tokens + output
    return need


def engine_flags(config: GatewayConfig) -> list[tuple[str, str | None, str]]:
    """(flag, value or None for a placeholder, why)."""
    admission = config.admission
    need = tier_context_need(config)
    bounded = [n for n in need.values() if n is not None]
    flags: list[tuple[str, str | None, str]] = []
    if bounded and len(bounded) == len(need):
        flags.append(("--max-model-len", str(max(bounded)), "largest tier prompt + max_tokens"))
    else:
        unbounded = sorted(k for k, v in need.items() if v is None)
        flags.append(
            (
                "--max-model-len",
                None,
                f"tiers {unbounded} set no max_prompt_tokens: set one "
                "so the engine can refuse what the gateway would",
            )
        )
    if admission.inflight_max is not None:
        flags.append(
            ("--max-num-seqs", str(admission.inflight_max), "admission.inflight_max per replica")
        )
    else:
        flags.append(
            ("--max-num-seqs", None, "set admission.inflight_max and use the same value here")
        )
    flags.append(
        (
            "--gpu-memory-utilization",
            None,
            "placeholder: 0.90 is vLLM's default; lower it if "
            "the GPU is shared, raise it only after measuring KV headroom",
        )
    )
    return flags


def warn_if_context_too_small(config: GatewayConfig, model: str, max_model_len: int) -> None:
    for tier, n in tier_context_need(config).items():
        if n is not None and n > max_model_len:
            log.warning(
                "model %s has max_model_len=%d, which cannot hold tier %r's prompt + output "
                "limits (%d tokens): the engine will refuse or clamp requests the gateway "
                "admits; lower the tier's limits or raise --max-model-len",
                model,
                max_model_len,
                tier,
                n,
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="gateway configuration file (YAML)")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        flags = engine_flags(config)
    except ConfigError as e:
        print(f"seawall engine-args: {e}", file=sys.stderr)
        return 2
    print("# vLLM flags that back up the limits in", args.config)
    parts = []
    for flag, value, why in flags:
        print(f"#   {flag}: {why}")
        parts.append(f"{flag} {value if value is not None else '<SET-ME>'}")
    print("vllm serve MODEL " + " ".join(parts))
    return 0
