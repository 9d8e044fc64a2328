"""``kimi-mlx plan``: how a model splits over Macs, whether it fits, and how fast it should run (README "Planning a
cluster"). Needs only the config (and a GGUF's header): nothing is loaded, so it runs on real-size models anywhere.

Exit status: 0 when every rank fits, 2 when one does not (the shortfall is printed) or on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import AFFINE_BITS, GROUP_SIZES
from ..ops.memory import FILL
from ..parallel.accounting import GB, Accounting, QuantSpec, account_config, account_gguf, checkpoint_tensor_names
from ..parallel.cost import (
    JACCL_TB5,
    ULTRA_BANDWIDTH_GBS,
    ULTRA_MIN_GIB,
    Host,
    Link,
    Plan,
    Speed,
    default_bandwidth,
    plan_pipeline,
    plan_tensor,
)
from ..parallel.splits import pipeline_ranges


def add_parser(commands) -> None:
    p = commands.add_parser(
        "plan",
        description="Plan a model over hosts without loading it: the layer (pipeline) or head/expert (tensor) split "
        "that load(parallel=...) makes, weight and cache bytes per rank at a context length, whether it fits, and "
        "predicted prefill/decode tokens/s from the cost model in the README. Exit status 2 when it does not fit.",
    )
    p.add_argument("--model", required=True, help="model directory, config.json, GGUF file (any shard), or HF repo "
                   "id (only its config.json is downloaded)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="Kimi-K3: the llama.cpp mmproj GGUF load will use (default: the checkpoint's vision tower, or "
                   "the mmproj*.gguf beside a --model GGUF); the tower's bytes are held by rank 0")
    p.add_argument("--hosts", required=True, metavar="GIB,...",
                   help="memory of each host in GiB (as Apple sizes unified memory), e.g. 512,512,192")
    p.add_argument("--wired-limit", metavar="GIB,...",
                   help="GPU working set per host in GiB, one value for all or one per host, 0 for a host's default: "
                   "for hosts whose limit was raised (sysctl iogpu.wired_limit_mb / 1024) or that report more than "
                   "the default (macOS 26 does; python -c \"import mlx.core as mx; "
                   "print(mx.device_info()['max_recommended_working_set_size'] / 2**30)\" on the host) (default: "
                   "macOS 13-15's: 2/3 of memory up to 32 GiB, 3/4 above)")
    p.add_argument("--bandwidth", metavar="GBPS,...", help="memory bandwidth per host in GB/s, one value for all or "
                   f"one per host (default: {ULTRA_BANDWIDTH_GBS} for hosts of {ULTRA_MIN_GIB} GiB or more, the "
                   "Ultra chips; otherwise unknown and decode is not predicted)")
    p.add_argument("--tflops", metavar="TFLOPS,...", help="compute per host in TFLOP/s (1e12), one value for all or "
                   "one per host (default: unknown: prefill is not predicted and decode is bandwidth-only)")
    p.add_argument("--link-bandwidth", type=float, default=JACCL_TB5.bandwidth_gbs, metavar="GBPS",
                   help=f"link bandwidth in GB/s (default {JACCL_TB5.bandwidth_gbs:g}: JACCL over Thunderbolt 5, "
                   "as reported)")
    p.add_argument("--link-latency-us", type=float, default=JACCL_TB5.latency_us, metavar="US",
                   help=f"latency per message in microseconds (default {JACCL_TB5.latency_us:g}: JACCL over "
                   "Thunderbolt 5; ring over TCP is ~10x)")
    p.add_argument("--context", type=int, default=32768, metavar="N",
                   help="tokens of context: the cache is sized for it, decode is predicted at it, prefill of it")
    p.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                   help="size the MLA latent cache quantized to this many bits (default: float, the model dtype)")
    p.add_argument("--kv-group-size", type=int, choices=GROUP_SIZES, default=64,
                   help="quantization group of the latent cache (with --kv-bits)")
    p.add_argument("--reserve", type=float, default=8.0, metavar="GIB",
                   help="memory per host kept for macOS and activations, in GiB (default 8): the most a host's GPU "
                   "can be given is memory - reserve")
    p.add_argument("--parallel", choices=("pipeline", "tensor"), default="pipeline")
    p.add_argument("--split", default=None, help="pipeline: 'even' or layer counts per rank such as '20,7' "
                   "(default: proportional to each host's GPU working set, as load splits)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="float weights (default: as stored; a GGUF's float tensors load as float32)")
    p.add_argument("--quantize", type=int, default=None, metavar="BITS",
                   help=f"quantize on load, MLX affine {', '.join(map(str, AFFINE_BITS))} bits (routers, norms, "
                   "AttnRes scores stay float; MXFP4 experts stay MXFP4)")
    p.add_argument("--q-group-size", type=int, default=64, choices=GROUP_SIZES)
    p.add_argument("--experts-mxfp4", action="store_true",
                   help="routed experts held as MXFP4 (as released Kimi-K3; implied by its quantization_config)")
    p.add_argument("--gguf-scales", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="GGUF: dtype of the affine scales/biases (as load's gguf_scale_dtype)")
    p.add_argument("--requantize", action="store_true",
                   help="GGUF: plan the types MLX has no layout for (Q6_K, Q3_K, Q2_K, IQ*) re-quantized to MLX "
                   "affine, as load's requantize=True (default: held as the file's GGML blocks, split on whole "
                   "blocks)")
    p.add_argument("--prefill-step-size", type=int, default=2048, metavar="N", help="prompt tokens per prefill chunk")
    p.set_defaults(run=run)


def _numbers(flag: str, text: str, n: int | None = None, zero: bool = False) -> list[float]:
    """Comma-separated positive numbers (``zero``: or 0); with ``n``, one value (for every host) or exactly ``n``."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated numbers such as '512,192'") from None
    if any(not (v > 0 or zero and v == 0) for v in values):
        raise ValueError(f"{flag} {text!r}: expected positive numbers" + (" (or 0)" if zero else ""))
    if n is not None and len(values) not in (1, n):
        raise ValueError(f"{flag} {text!r}: {len(values)} values for {n} hosts; expected one, or one per host")
    return values * n if n is not None and len(values) == 1 else values


def hosts_from_args(args: argparse.Namespace) -> list[Host]:
    memory = _numbers("--hosts", args.hosts)
    n = len(memory)
    bandwidth = _numbers("--bandwidth", args.bandwidth, n) if args.bandwidth else [default_bandwidth(m) for m in memory]
    tflops = _numbers("--tflops", args.tflops, n) if args.tflops else [None] * n
    wired = _numbers("--wired-limit", args.wired_limit, n, zero=True) if args.wired_limit else [0] * n
    return [Host(m, b, t, w or None) for m, b, t, w in zip(memory, bandwidth, tflops, wired)]


def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--context", args.context), ("--prefill-step-size", args.prefill_step_size)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not args.link_bandwidth > 0:
        raise ValueError(f"--link-bandwidth must be positive, got {args.link_bandwidth:g}")
    for flag, value in (("--link-latency-us", args.link_latency_us), ("--reserve", args.reserve)):
        if not value >= 0:
            raise ValueError(f"{flag} must be >= 0, got {value:g}")
    if args.quantize is not None and args.quantize not in AFFINE_BITS:
        raise ValueError(f"--quantize {args.quantize}: MLX affine quantization supports {AFFINE_BITS} bits")
    if args.split is not None and args.parallel != "pipeline":
        raise ValueError(f"--split {args.split!r}: only --parallel pipeline takes a split")


def accounting_from_args(args: argparse.Namespace) -> Accounting:
    """The model's bytes as loaded, from a GGUF header, a config.json, a model directory or an HF repo's config."""
    quantize = None if args.quantize is None else QuantSpec(args.quantize, args.q_group_size)
    model = str(args.model)
    if model.endswith(".gguf"):
        if args.experts_mxfp4:
            raise ValueError("--experts-mxfp4: a GGUF's tensor types decide how its experts are held")
        return account_gguf(model, args.dtype, quantize, args.gguf_scales, args.requantize, args.mmproj)
    path = Path(model).expanduser()
    names = None
    if path.is_dir():
        names = checkpoint_tensor_names(path)
        path = path / "config.json"
    elif not path.exists():
        path = _download_config(model)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {model}: cannot read {path} as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model {model}: {path} is not a JSON object")
    return account_config(raw, str(path), args.dtype, quantize, args.experts_mxfp4, names, args.mmproj)


def _download_config(repo: str) -> Path:
    if repo.count("/") != 1 or repo.startswith((".", "/", "~")):
        raise ValueError(f"--model {repo}: no such file or directory, and not an HF repo id of the form 'org/name'")
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, "config.json"))
    except Exception as e:  # offline, 404, gated, network: huggingface_hub raises many types
        raise ValueError(f"--model {repo}: not a local path, and downloading its config.json from the Hugging Face "
                         f"Hub failed ({type(e).__name__}: {e})") from None


def run(args: argparse.Namespace) -> int:
    try:
        _check(args)
        hosts = hosts_from_args(args)
        acct = accounting_from_args(args)
        link = Link(args.link_bandwidth, args.link_latency_us)
        common = dict(context=args.context, reserve_gib=args.reserve, prefill_chunk=args.prefill_step_size,
                      kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
        if args.split is not None:
            try:
                pipeline_ranges(acct.layer_bytes(), [1] * len(hosts), args.split)
            except ValueError as e:
                raise ValueError(f"--split {args.split}: {e}") from None
        if args.parallel == "pipeline":
            plan = plan_pipeline(acct, hosts, link, args.split, **common)
        else:
            plan = plan_tensor(acct, hosts, link, **common)
    except (OSError, ValueError) as e:
        print(f"kimi-mlx: error: {e}", file=sys.stderr)
        return 2
    print(report(plan))
    return 0 if plan.fits else 2


# ------------------------------------------------------------------------------------------------ printing

def report(plan: Plan) -> str:
    """The plan as text: model, per-rank table, fit verdict, predicted speeds."""
    unit = (GB, "GB") if plan.acct.total >= GB else (1e6, "MB")
    return "\n".join(_model_lines(plan.acct, unit) + [""] + _table(plan, unit) + [""] + _verdict(plan, unit)
                     + _speeds(plan))


def _count(n: float) -> str:
    for scale, suffix in ((1e12, " T"), (1e9, " B"), (1e6, " M")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:,.0f}"


def _model_lines(acct: Accounting, unit: tuple[float, str]) -> list[str]:
    cfg, (size, name) = acct.cfg, unit
    n_kda = len(cfg.kda_layers)
    experts = f", {cfg.num_experts} routed experts ({cfg.num_experts_per_token} per token)" if cfg.num_experts else ""
    layouts = " + ".join(f"{layout} {b / size:,.2f}" for layout, b in acct.by_layout().items())
    vision = acct.part_bytes("vision")
    tower = [f"  vision tower + projector: {vision / size:,.2f} {name}, held by rank 0 (included above)"] if vision else []
    return [
        f"{cfg.model_type} from {acct.source}",
        f"  {cfg.num_hidden_layers} layers ({n_kda} KDA, {cfg.num_hidden_layers - n_kda} MLA){experts}, "
        f"{_count(sum(p.numel for p in acct.params))} parameters",
        f"  weights as loaded: {acct.total / size:,.2f} {name} = {layouts}",
    ] + tower


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1} ({len(r)})" if len(r) else "none (0)"


def _table(plan: Plan, unit: tuple[float, str]) -> list[str]:
    size, name = unit
    if plan.mode == "pipeline":
        split_head = ["layers"]
        splits = [[_span(r.layers)] for r in plan.ranks]
    else:
        fields = ("kda_heads", "mla_heads", "experts", "ffn", "shared")
        split_head = ["KDA heads", "MLA heads", "experts", "MLP cols", "shared cols"]
        splits = [[_span(getattr(r.share, f)) for f in fields] for r in plan.ranks]
    head = ["rank", "memory", "bandwidth"] + split_head + ["weights", "cache", "needs", "GPU set", "usable", "free"]
    rows = [[str(r.rank), f"{r.host.memory_gib:g} GiB",
             f"{r.host.bandwidth_gbs:g} GB/s" if r.host.bandwidth_gbs else "?"] + s
            + [f"{b / size:,.2f}" for b in (r.weights, r.cache, r.need, r.host.working_set, r.usable, r.free)]
            for r, s in zip(plan.ranks, splits)]
    widths = [max(len(row[i]) for row in [head] + rows) for i in range(len(head))]
    left = range(3, 3 + len(split_head))  # split columns read left to right; numbers align right

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    kv = "float" if plan.kv_bits is None else f"{plan.kv_bits}-bit g{plan.kv_group_size}"
    title = (f"{plan.mode} over {len(plan.ranks)} host(s), context {plan.context:,} tokens ({kv} latent cache), "
             f"{plan.reserve_gib:g} GiB "
             f"reserved per host; sizes in {name} (1{'e9' if name == 'GB' else 'e6'} bytes), host memory in GiB "
             f"(2^30 bytes); GPU set: the host's GPU working set (what macOS lets the GPU wire), usable: memory - "
             f"reserve")
    return [title, line(head)] + [line(row) for row in rows]


def _verdict(plan: Plan, unit: tuple[float, str]) -> list[str]:
    if not plan.fits:
        return ["DOES NOT FIT:"] + [f"  {line}" for line in plan.shortfall()]
    least = min(plan.ranks, key=lambda r: r.free)
    room = f"fits: every rank has room (least free: rank {least.rank}, {least.free / unit[0]:,.2f} {unit[1]})"
    if all(r.wired_ok for r in plan.ranks):
        fullest = max(plan.ranks, key=lambda r: r.need / r.host.working_set)
        return [f"{room}, within each host's GPU working set (fullest: rank {fullest.rank}, "
                f"{fullest.need / fullest.host.working_set:.0%} of it)"]
    lines = _raise_lines(plan, plan.wired_limits())
    return [f"{room} once the GPU wired limit is raised:"] + [f"  {line}" for line in lines]


def _raise_lines(plan: Plan, limits: dict[int, int]) -> list[str]:
    """What is short of the GPU working set, and the ``sysctl`` per host that fixes it."""
    short = ", ".join(f"rank {r.rank} {r.need / r.host.working_set:.0%}" for r in plan.ranks if not r.wired_ok)
    lines = [f"a host's GPU keeps only its working set wired (GPU set: macOS's default unless --wired-limit); a "
             f"rank's needs should take at most {FILL:.0%} of it, the rest being for activations (past it, memory "
             f"is paged in and out between tokens): {short}"]
    by_value: dict[int, list[int]] = {}
    for rank, mib in limits.items():
        by_value.setdefault(mib, []).append(rank)
    for mib, ranks in sorted(by_value.items()):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"on the host of {who}: sudo sysctl iogpu.wired_limit_mb={mib} ({mib / 1024:,.1f} GiB; until "
                     "reboot)")
    if plan.split_by_working_set and len(limits) > 1:
        lines.append("(every host raised by the same factor, so load's split by working set stays the planned one)")
    tight = plan.tight(limits)
    if tight:
        lines.append(f"TIGHT: rank(s) {tight} still take more than {FILL:.0%} at the most memory - reserve allows: "
                     "little room for activations (quantize, or use more or larger hosts)")
    lines.append("a host that already has that much (a raised limit, or macOS 26's larger default) needs nothing: "
                 "give its working set with --wired-limit")
    return lines


def _speeds(plan: Plan) -> list[str]:
    lines = []
    d = plan.decode
    if d is None:
        missing = [r.rank for r in plan.ranks if r.host.bandwidth_gbs is None]
        lines.append(f"decode: not predicted: no memory bandwidth for rank(s) {missing} (pass --bandwidth GB/s; "
                     f"the default covers only hosts of {ULTRA_MIN_GIB} GiB or more)")
    else:
        bound = "bandwidth and compute" if all(r.host.tflops for r in plan.ranks) else "bandwidth only: no --tflops"
        sent = f"; {plan.link_bytes / 1e3:.1f} kB sent per token by the busiest rank" if len(plan.ranks) > 1 else ""
        lines.append(f"decode at {plan.context:,} tokens of context: {d.tokens_per_s:.2f} tok/s "
                     f"({d.seconds * 1e3:.2f} ms/token: {_parts(d, 'ms')}; {bound}{sent})")
    p = plan.prefill
    if p is None:
        lines.append("prefill: not predicted: pass --tflops (and --bandwidth) for every host")
    else:
        lines.append(f"prefill of {plan.context:,} tokens: {p.tokens_per_s:,.1f} tok/s ({p.seconds:,.2f} s: "
                     f"{_parts(p, 's')})")
    return lines


def _parts(s: Speed, unit: str) -> str:
    """The terms of a predicted time in ``unit`` ("ms" or "s")."""
    k = 1e3 if unit == "ms" else 1.0
    stages = " + ".join(f"{t * k:,.2f}" for t in s.compute) if s.serial else \
        "max(" + ", ".join(f"{t * k:,.2f}" for t in s.compute) + ")"
    head = f", head {s.head * k:,.2f} {unit}" if s.head else ""
    links = f", links {s.links * k:,.2f} {unit}" if s.links else ""
    return f"ranks {stages} {unit}{head}{links}"
