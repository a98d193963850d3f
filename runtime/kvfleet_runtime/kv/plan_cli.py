"""``kvfleet plan``: KV-cache sizing for a model on a GPU pool (a thin shell over :mod:`.sizing`).

The architecture comes from ``--preset``, ``--config-json`` or explicit flags (explicit flags also
override single fields of a preset or config). Output is a human table, or ``--output json`` whose keys
are those of :class:`kvfleet_runtime.kv.sizing.Plan` (stable; tests pin them). Bad input prints one line
``kvfleet plan: error: ...`` on stderr and returns exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from fractions import Fraction
from typing import Any, TextIO

from pydantic import ValidationError

from kvfleet_runtime.kv.hfconfig import read_hf_config
from kvfleet_runtime.kv.presets import PRESETS, get_preset
from kvfleet_runtime.kv.sizing import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_NVME_GBPS,
    DEFAULT_PCIE_GBPS,
    ModelArchitecture,
    Plan,
    PlanRequest,
    SizingError,
    TierNeed,
    build_model_architecture,
    build_plan,
    format_bytes,
    format_validation_error,
    parse_byte_size,
    parse_count,
    parse_kv_cache_dtype,
    parse_token_count,
    parse_weight_dtype,
)

EXIT_BAD_INPUT = 2

#: Explicit architecture flags: (flag dest, parser of its text).
_ARCH_FLAGS: dict[str, Callable[[str], Any]] = {
    "num_layers": parse_count,
    "num_attention_heads": parse_count,
    "num_kv_heads": parse_count,
    "head_dim": parse_count,
    "hidden_size": parse_count,
    "kv_lora_rank": parse_count,
    "qk_rope_head_dim": parse_count,
    "num_parameters": parse_count,
    "weight_dtype": parse_weight_dtype,
    "num_experts": parse_count,
    "num_experts_per_token": parse_count,
}


def register(subparsers: Any) -> None:
    """Add the ``plan`` sub-command to the ``kvfleet`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="KV-cache sizing: bytes per token, blocks and tokens per replica, sessions, tiers, restores.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_argument_group("model (one of --preset / --config-json, or explicit fields)")
    source.add_argument("--preset", help=f"well-known architecture: {', '.join(PRESETS)}")
    source.add_argument("--config-json", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    source.add_argument("--name", help="model name shown in the output")
    for dest in _ARCH_FLAGS:
        source.add_argument(
            f"--{dest.replace('_', '-')}", dest=dest, metavar="N" if dest != "weight_dtype" else "DTYPE"
        )

    engine = parser.add_argument_group("engine and pool")
    engine.add_argument("--kv-dtype", default="auto", help="auto|bfloat16|float16|fp8|fp8_e4m3|fp8_e5m2")
    engine.add_argument("--block-size", default=str(DEFAULT_BLOCK_SIZE), help="tokens per KV block")
    engine.add_argument("--gpus-per-replica", help="GPUs per replica (= tensor x pipeline parallel)")
    engine.add_argument("--tensor-parallel", help="tensor-parallel size")
    engine.add_argument("--pipeline-parallel", help="pipeline-parallel size (default 1)")
    engine.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 141GB, 80GiB")
    engine.add_argument("--gpu-memory-utilization", default="0.9", help="0..1")
    engine.add_argument(
        "--reserve",
        default="2GiB",
        help="per-GPU memory for activations, CUDA graphs and workspaces beyond the weights (default 2GiB)",
    )
    engine.add_argument("--weight-bytes-per-gpu", help="override the computed weight bytes per GPU")
    engine.add_argument("--replicas", default="1", help="replicas in the pool")

    work = parser.add_argument_group("workload and tiers")
    work.add_argument("--context", help="tokens per session, e.g. 8192 or 128K (K = 1024)")
    work.add_argument("--sessions", help="concurrent sessions the workload keeps cached")
    work.add_argument("--cpu-tier", help="LMCache CPU tier per replica, e.g. 256Gi")
    work.add_argument("--nvme-tier", help="LMCache NVMe tier per replica, e.g. 2Ti")
    work.add_argument("--pcie-gbps", default=str(DEFAULT_PCIE_GBPS), help="host-to-GPU GB/s per GPU")
    work.add_argument("--nvme-gbps", default=str(DEFAULT_NVME_GBPS), help="NVMe read GB/s per replica")
    parser.add_argument("--output", default="table", help="table (default) or json")
    parser.set_defaults(func=run_plan)


def build_plan_request(args: argparse.Namespace) -> PlanRequest:
    """The :class:`PlanRequest` the flags describe; :class:`SizingError` for any bad or missing value."""
    name, arch = _architecture(args)
    tp, pp = _parallel(args)
    return PlanRequest(
        model_name=name,
        architecture=arch,
        kv_cache_dtype=parse_kv_cache_dtype(args.kv_dtype),
        block_size=_positive(args.block_size, "--block-size"),
        tensor_parallel=tp,
        pipeline_parallel=pp,
        gpu_memory_bytes=parse_byte_size(args.gpu_memory),
        gpu_memory_utilization=_fraction(args.gpu_memory_utilization, "--gpu-memory-utilization"),
        reserve_bytes_per_gpu=parse_byte_size(args.reserve),
        weight_bytes_per_gpu=None
        if args.weight_bytes_per_gpu is None
        else parse_byte_size(args.weight_bytes_per_gpu),
        replicas=_positive(args.replicas, "--replicas"),
        context_tokens=None if args.context is None else _positive(args.context, "--context", tokens=True),
        sessions=None if args.sessions is None else parse_count(args.sessions),
        cpu_tier_bytes_per_replica=None if args.cpu_tier is None else parse_byte_size(args.cpu_tier),
        nvme_tier_bytes_per_replica=None if args.nvme_tier is None else parse_byte_size(args.nvme_tier),
        pcie_gbps=_fraction(args.pcie_gbps, "--pcie-gbps"),
        nvme_gbps=_fraction(args.nvme_gbps, "--nvme-gbps"),
    )


def run_plan(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the plan; 0 on success, 2 (one line on stderr) on impossible input."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        if args.output not in ("table", "json"):
            raise SizingError(f"--output must be table or json, got {args.output!r}")
        plan = build_plan(build_plan_request(args))
    except SizingError as exc:
        print(f"kvfleet plan: error: {exc}", file=err)
        return EXIT_BAD_INPUT
    except ValidationError as exc:
        print(f"kvfleet plan: error: {format_validation_error(exc)}", file=err)
        return EXIT_BAD_INPUT
    if args.output == "json":
        out.write(json.dumps(plan.model_dump(mode="json"), indent=2) + "\n")
    else:
        out.write(render_plan_table(plan))
    return 0


# ------------------------------------------------------------------------------------------- parsing


def _positive(text: str, flag: str, *, tokens: bool = False) -> int:
    value = parse_token_count(text) if tokens else parse_count(text)
    if value < 1:
        raise SizingError(f"{flag} must be at least 1, got {text!r}")
    return value


def _fraction(text: str, flag: str) -> Fraction:
    try:
        return Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise SizingError(f"{flag} must be a number, got {text!r}") from None


def _architecture(args: argparse.Namespace) -> tuple[str, ModelArchitecture]:
    if args.preset and args.config_json:
        raise SizingError("give --preset or --config-json, not both")
    explicit = {
        dest: parse(getattr(args, dest)) for dest, parse in _ARCH_FLAGS.items() if getattr(args, dest)
    }
    if args.preset:
        preset = get_preset(args.preset)
        name, fields = preset.name, preset.architecture.model_dump()
    elif args.config_json:
        name, arch = read_hf_config(args.config_json, num_parameters=explicit.get("num_parameters"))
        fields = arch.model_dump()
    else:
        missing = [
            f"--{d.replace('_', '-')}"
            for d in ("num_layers", "num_attention_heads", "hidden_size", "num_parameters")
            if d not in explicit
        ]
        if missing:
            raise SizingError(
                "no model: give --preset NAME, --config-json PATH, or explicit fields "
                f"(missing {', '.join(missing)})"
            )
        heads, hidden = explicit["num_attention_heads"], explicit["hidden_size"]
        name = "custom"
        fields = {
            "num_kv_heads": heads,
            "head_dim": hidden // heads if heads else 0,
            "weight_dtype": "bfloat16",
        }
    fields.update(explicit)
    return args.name or name, build_model_architecture(**fields)


def _parallel(args: argparse.Namespace) -> tuple[int, int]:
    pp = 1 if args.pipeline_parallel is None else _positive(args.pipeline_parallel, "--pipeline-parallel")
    gpus = None if args.gpus_per_replica is None else _positive(args.gpus_per_replica, "--gpus-per-replica")
    if args.tensor_parallel is not None:
        tp = _positive(args.tensor_parallel, "--tensor-parallel")
    elif gpus is not None:
        if gpus % pp:
            raise SizingError(f"--gpus-per-replica {gpus} is not a multiple of --pipeline-parallel {pp}")
        tp = gpus // pp
    else:
        tp = 1
    if gpus is not None and tp * pp != gpus:
        raise SizingError(
            f"--gpus-per-replica {gpus} must equal --tensor-parallel {tp} x --pipeline-parallel {pp}"
        )
    return tp, pp


# ------------------------------------------------------------------------------------------ rendering


def _n(value: int) -> str:
    return f"{value:,}"


def _b(value: int) -> str:
    return f"{format_bytes(value)} ({value:,} B)"


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _tier_line(tier: TierNeed) -> str:
    if tier.capacity_bytes is None:
        return f"needs {format_bytes(tier.needed_bytes)} (no tier configured)"
    verdict = "fits" if tier.fits else "does NOT fit"
    return (
        f"needs {format_bytes(tier.needed_bytes)} of {format_bytes(tier.capacity_bytes)}: {verdict} "
        f"({_n(tier.sessions_fit or 0)} sessions fit)"
    )


def render_plan_table(plan: Plan) -> str:
    """The plan as an aligned two-column table for humans."""
    arch, eng, tok, cap = plan.model.architecture, plan.engine, plan.kv_per_token, plan.capacity
    mla = f", MLA latent {arch.kv_lora_rank}+{arch.qk_rope_head_dim}" if arch.is_mla else ""
    moe = f", {arch.num_experts} experts (top-{arch.num_experts_per_token})" if arch.is_moe else ""
    rows: list[tuple[str, str]] = [
        ("model", f"{plan.model.name} ({plan.model.attention})"),
        (
            "architecture",
            f"{arch.num_layers} layers, {arch.num_attention_heads} heads, {arch.num_kv_heads} KV heads, "
            f"head dim {arch.head_dim}{mla}{moe}",
        ),
        ("parameters", f"{arch.num_parameters / 1e9:,.2f} B ({arch.weight_dtype.value} weights)"),
        ("KV dtype", f"{eng.kv_cache_dtype.value} ({eng.kv_cache_dtype_bytes} B/element)"),
        (
            "replica",
            f"{eng.gpus_per_replica} GPU(s) (TP {eng.tensor_parallel} x PP {eng.pipeline_parallel}) of "
            f"{format_bytes(eng.gpu_memory_bytes)} at {eng.gpu_memory_utilization:g}; "
            f"{eng.replicas} replica(s)",
        ),
        ("", ""),
        ("KV per token (model)", _b(tok.bytes)),
        (
            "KV per token per GPU",
            f"{_b(tok.bytes_per_gpu)}; "
            + ("1 latent (replicated)" if arch.is_mla else f"{tok.kv_heads_per_gpu} KV head(s)")
            + f" x {tok.layers_per_gpu} layers",
        ),
        ("KV per token per replica", _b(tok.bytes_per_replica)),
        ("KV per token offloaded", _b(tok.offload_bytes)),
        ("block", f"{eng.block_size} tokens = {_b(cap.bytes_per_block_per_gpu)} per GPU"),
        ("", ""),
        ("per GPU: usable", _b(cap.usable_bytes_per_gpu)),
        ("per GPU: weights", _b(cap.weight_bytes_per_gpu)),
        ("per GPU: reserve", _b(cap.reserve_bytes_per_gpu)),
        ("per GPU: KV space", _b(cap.kv_bytes_per_gpu)),
        ("blocks per replica", _n(cap.blocks_per_replica)),
        ("tokens per replica", _n(cap.tokens_per_replica)),
        (
            "tokens in pool",
            f"{_n(cap.tokens_pool)} ({_n(cap.blocks_pool)} blocks, {format_bytes(cap.kv_bytes_pool)})",
        ),
    ]
    if plan.sessions is not None:
        s = plan.sessions
        rows += [
            ("", ""),
            (
                f"sessions of {_n(s.context_tokens)} tokens",
                f"{_n(s.per_replica)} per replica, {_n(s.pool)} in pool "
                f"({_n(s.blocks_per_session)} blocks each)",
            ),
        ]
    if plan.workload is not None:
        w = plan.workload
        rows += [
            (
                "workload",
                f"{_n(w.sessions)} x {_n(w.context_tokens)} tokens = {_n(w.tokens)} tokens, "
                f"{format_bytes(w.logical_bytes)} of KV (model)",
            ),
            ("  on HBM", f"{_tier_line(w.hbm)}; {_n(w.replicas_needed)} replica(s) needed"),
            ("  on CPU", _tier_line(w.cpu)),
            ("  on NVMe", _tier_line(w.nvme)),
        ]
    if plan.restore is not None:
        r = plan.restore
        rows += [
            (
                "restore from CPU",
                f"{_seconds(r.cpu_seconds)} ({format_bytes(r.bytes_per_gpu)} per GPU "
                f"at {r.pcie_gbps:g} GB/s)",
            ),
            (
                "restore from NVMe",
                f"{_seconds(r.nvme_seconds)} ({format_bytes(r.offload_bytes)} at {r.nvme_gbps:g} GB/s)",
            ),
        ]
    width = max(len(label) for label, _ in rows)
    return "".join(f"{label:<{width}}  {value}".rstrip() + "\n" for label, value in rows)
