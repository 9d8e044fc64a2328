"""Per-module prefill profile: each module's time (forced evaluation), the FLOPs it must do, and its share of the
float32 GEMM rate measured in the same process; plus the whole-model prefill.

Models (float32, batch 1, one prefill call of ``--tokens`` tokens into a fresh cache):

- ``--model real`` (default): the real-width slice of Kimi-Linear-48B: 3 layers (KDA, KDA, MLA), hidden 2304,
  KDA 32 heads x 128, MLA 32 heads (kv_lora 512, qk_nope 128, qk_rope 64, v 128), layer 0 a dense MLP of 9216, then
  64 experts x 1024 top-8 + 1 shared expert, vocab 8192. Random weights drawn in MLX with the scales of
  ``bench_vs_mlx_lm.make_checkpoint`` (nothing written to disk: the float32 model is ~4.3 GiB).
- ``--model narrow``: ``bench_vs_mlx_lm.py``'s model (hidden 768, 12 layers, 16 experts top-4), loaded from its
  cached checkpoint (written on first use).

Each repeat (after one warm-up) runs, back to back: the reference GEMM (``mx.matmul`` of [T, hidden] x
[hidden, 4096], the widest projection's shape; median of 3 calls), the staged forward (the model's forward cut into
the modules below, each evaluated before the next starts and each preceded by a probe GEMM of [512, hidden] x
[hidden, 4096]), and the whole model's prefill (``model(tokens, cache)``, evaluated once, between two probes).
A module's share of the GEMM rate is its FLOPs over (its time x the probe rate just before it), so a machine whose
load changes during the run (shared cores) compares each module with the GEMM under the same load. Medians over
``--repeats``; the spread is printed as min-max.

Rows: KDA (projections; short conv; gates: q/k L2 norm, decay, beta; chunked scan; output RMSNorm * gate; o_proj),
MLA (projections incl. the latent norm and the cache write; attention incl. the per-head K/V expansion; o_proj),
MoE (router; routed experts incl. the weighted sum; shared expert), dense MLP, head (final norm + lm_head), and
"norms, residuals, embedding". FLOPs: 2 m n k per matmul; for the scan the chunked form with 16-token chunks
(per token and head 6 Dk Dv for the state terms plus 2 * 16 * (3 Dk + 2 Dv) inside the chunk); causal attention
counts T (T + 1) / 2 query-key pairs; elementwise modules count 0 (any time they take is above the GEMM bound).
``share`` = FLOPs / (time x the probe's FLOP/s). Also printed: process CPU time per module. ``--baseline NAME``
runs an earlier behaviour (``BASELINES``) interleaved with the current code in every repeat and prints per-module
ratios current / baseline.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/profile_prefill.py
    LD_PRELOAD=... python bench/profile_prefill.py --model narrow --tokens 2048 --repeats 3
    LD_PRELOAD=... python bench/profile_prefill.py --baseline moe-copied-experts
    python bench/profile_prefill.py --baseline moe-sorted-loop-on-gpu    # on a Mac: the MoE GPU dispatch
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_mlx_lm import CONFIG, blas_in_use, checkpoint_dir, describe, load_kimi  # noqa: E402

from kimi_mlx.config import KimiConfig  # noqa: E402
from kimi_mlx.layers import kda as kda_layer  # noqa: E402
from kimi_mlx.layers.kda import short_conv  # noqa: E402
from kimi_mlx.layers.moe import switch_glu  # noqa: E402
from kimi_mlx.models.kimi_linear import Model, layer_masks  # noqa: E402
from kimi_mlx.ops.kda import kda_forward  # noqa: E402
from kimi_mlx.ops.kda_gates import kda_prologue  # noqa: E402
from kimi_mlx.ops.mla_attention import mla_attention  # noqa: E402

REAL_WIDTH = {
    **CONFIG,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 3,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 64,
    "num_experts_per_token": 8,
    "linear_attn_config": {
        "full_attn_layers": [3],
        "kda_layers": [1, 2],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
}
SCAN_CHUNK = 16  # the chunk size the scan's FLOP count assumes (fla's 16-row sub-chunks)
GEMM_OUT = 4096  # reference GEMM: [T, hidden] x [hidden, GEMM_OUT]
PROBE_ROWS = 512  # the probe before each module: [PROBE_ROWS, hidden] x [hidden, GEMM_OUT]


# ------------------------------------------------------------------------------------------------- the model
def random_model(config: dict, seed: int = 0) -> Model:
    """A float32 ``Model`` for ``config`` with random weights in ``bench_vs_mlx_lm.make_checkpoint``'s scales
    (matrices N(0, 1/in), o/down projections x0.5, norms 1 + 0.05 N, A_log log U(1, 20), dt_bias 0.5 N - 2, convs
    0.5 N, router bias 0.05 N, embedding N(0, 1)), drawn in MLX one tensor at a time."""
    model = Model(KimiConfig.from_hf(config))
    randomize(model, seed)
    model.eval()
    return model


def randomize(module, seed: int = 0) -> None:
    """Draw every parameter of ``module`` in the scales ``random_model`` describes (in place)."""
    key = mx.random.key(seed)
    params = []
    for name, p in tree_flatten(module.parameters()):
        key, sub = mx.random.split(key)
        n = mx.random.normal(p.shape, key=sub)
        if name.endswith("A_log"):
            w = mx.log(mx.random.uniform(1.0, 20.0, p.shape, key=sub))
        elif name.endswith("dt_bias"):
            w = 0.5 * n - 2.0
        elif name.endswith("qkv_conv.weight"):
            w = 0.5 * n
        elif name.endswith("e_score_correction_bias"):
            w = 0.05 * n
        elif name.endswith("embed_tokens.weight"):
            w = n
        elif p.ndim == 1:  # norm weights
            w = 1.0 + 0.05 * n
        else:
            fan_in = p.shape[-2] if name.endswith("embed_q.weight") else p.shape[-1]  # both halves of kv_b: in = r
            gain = 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            w = n * (gain / fan_in**0.5)
        mx.eval(w)
        params.append((name, w))
    module.update(tree_unflatten(params))


# ------------------------------------------------------------------------------------------------- FLOPs
def module_flops(cfg: KimiConfig, T: int, kind: str) -> float:
    """The FLOPs module ``kind`` must do for T prefill tokens (see the module docstring)."""
    h, H, D = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    P = H * D
    mh, r = cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    mm = lambda m, n, k: 2.0 * m * n * k  # noqa: E731
    full_rank_gate = cfg.kda_full_rank_gate
    gate = mm(T, P, h) if full_rank_gate else mm(T, D, h) + mm(T, P, D)
    pairs = T * (T + 1) / 2
    return {
        "KDA projections": mm(T, 3 * P, h) + mm(T, D, h) + mm(T, P, D) + mm(T, H, h) + gate,
        "KDA scan": 2.0 * T * H * (3 * D * D + SCAN_CHUNK * (3 * D + 2 * D)),
        "KDA o_proj": mm(T, h, P),
        "MLA projections": mm(T, mh * (dn + dr), h) + mm(T, r + dr, h),
        "MLA attention": mm(T, mh * (dn + dv), r) + 2.0 * pairs * mh * (dn + dr + dv),
        "MLA o_proj": mm(T, h, mh * dv),
        "MoE router": mm(T, cfg.num_experts, h),
        "MoE routed experts": 3 * mm(T * cfg.num_experts_per_token, cfg.moe_intermediate_size, h),
        "MoE shared expert": 3 * mm(T, cfg.moe_intermediate_size * cfg.num_shared_experts, h),
        "dense MLP": 3 * mm(T, cfg.intermediate_size, h),
        "head (norm + lm_head)": mm(T, cfg.vocab_size, h),
    }.get(kind, 0.0)


# ------------------------------------------------------------------------------------------------- staged forward
class Stages:
    """Runs a step and evaluates its outputs, adding the time to its row (inputs are already evaluated). With a
    ``probe`` (a reference GEMM: () -> FLOP/s), each step is preceded by the probe and its row also accumulates
    ``time x probe rate``, the FLOPs the machine's GEMM would have done in that time under the same load."""

    def __init__(self, probe=None):
        self.probe = probe
        self.times: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)  # process CPU seconds (all threads)
        self.gemm_flops: dict[str, float] = defaultdict(float)

    def __call__(self, row: str, fn, *args):
        rate = self.probe() if self.probe else 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        mx.eval(out)
        dt = time.perf_counter() - t0
        self.cpu[row] += time.process_time() - c0
        self.times[row] += dt
        self.gemm_flops[row] += dt * rate
        return out


def kda_staged(st: Stages, attn, x: mx.array, cache, mask) -> mx.array:
    """``KimiDeltaAttention.__call__`` (fresh cache, no padding) cut into its modules. x: [B, T, hidden]."""
    B, T, _ = x.shape
    H, D = attn.num_heads, attn.head_dim
    p = attn._core_params()
    qkv, f, b, g = st("KDA projections", lambda: (attn._qkv(x), attn.f_b_proj(attn.f_a_proj(x)), attn.b_proj(x),
                                                  attn._gate(x)))
    conv0 = mx.zeros((B, attn.conv_kernel - 1, qkv.shape[-1]), dtype=qkv.dtype)
    qkv, conv_state = st("KDA short conv", short_conv, qkv, p.conv_weight, conv0)

    def gates():
        q, k, v = (t.reshape(B, T, H, -1) for t in mx.split(qkv, 3, axis=-1))
        qn, kn, gg, beta = kda_prologue(q, k, f.reshape(B, T, H, D), b, p.A_log, p.dt_bias,
                                        lower_bound=p.lower_bound, l2_eps=p.l2_eps)
        return qn, kn, v, gg, beta

    qn, kn, v, gg, beta = st("KDA gates (L2 norm, decay, beta)", gates)
    state0 = mx.zeros((B, H, D, D), dtype=mx.float32)
    o, state = st("KDA scan", lambda: kda_forward(qn, kn, v, gg, beta, state=state0, mask=mask))

    def out_norm():
        return kda_layer.gated_rms_norm(o, g.reshape(B, T, H, D), p.norm_weight, p.norm_eps).reshape(B, T, H * D)

    y = st("KDA output norm * gate", out_norm)
    cache.conv_state, cache.recurrent_state = conv_state, state
    cache.advance(T)
    return st("KDA o_proj", lambda: attn.o_proj(y.astype(x.dtype)))


def mla_staged(st: Stages, attn, x: mx.array, cache, mask) -> mx.array:
    """``KimiMLA.__call__`` cut into its modules. x: [B, T, hidden]."""
    B, T, _ = x.shape

    def projections():
        q = attn._q(x).reshape(B, T, attn.num_heads, attn.nope + attn.rope).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [attn.nope], axis=-1)
        kv_latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.rank], axis=-1)
        kv_latent, k_pe = cache.update_and_fetch(attn.kv_a_layernorm(kv_latent)[:, None], k_pe[:, None])
        return q_nope, q_pe, kv_latent, k_pe

    q_nope, q_pe, kv_latent, k_pe = st("MLA projections", projections)
    out = st("MLA attention", lambda: mla_attention(q_nope, q_pe, kv_latent, k_pe, attn.embed_q, attn.unembed_out,
                                                     attn.scale, mask, key_block=attn.key_block))
    out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)
    if "g_proj" in attn:
        out = st("MLA output gate", lambda: out * mx.sigmoid(attn.g_proj(x)))
    return st("MLA o_proj", lambda: attn.o_proj(out))


def moe_staged(st: Stages, moe, x: mx.array) -> mx.array:
    """``SparseMoE.__call__`` (no latent MoE) cut into router, routed experts and shared expert."""
    inds, weights = st("MoE router", moe.routing, x)

    def experts():
        y = switch_glu(moe.switch_mlp, x, inds)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)

    y = st("MoE routed experts", experts)
    if "shared_experts" in moe:
        y = y + st("MoE shared expert", moe.shared_experts, x)
    return y


def staged_forward(model: Model, tokens: mx.array, probe=None) -> tuple[mx.array, Stages]:
    """The model's prefill of ``tokens`` [1, T] into a fresh cache, module by module: (logits, the ``Stages`` with
    each row's seconds and, with ``probe``, its GEMM-equivalent FLOPs)."""
    st = Stages(probe)
    other = "norms, residuals, embedding"
    cache = model.make_cache()
    T = tokens.shape[1]
    kda_mask, attn_mask = layer_masks(T, cache)
    h = st(other, model.model.embed, tokens)
    for layer, c in zip(model.layers, cache):
        x = st(other, layer.input_layernorm, h)
        if layer.is_linear:
            a = kda_staged(st, layer.self_attn, x, c, kda_mask)
        else:
            a = mla_staged(st, layer.self_attn, x, c, attn_mask)
        h, x = st(other, lambda: (h + a, layer.post_attention_layernorm(h + a)))
        if "switch_mlp" in layer.mlp:
            m = moe_staged(st, layer.mlp, x)
        else:
            m = st("dense MLP", layer.mlp, x)
        h = st(other, lambda: h + m)
    logits = st("head (norm + lm_head)", lambda: model.lm_head(model.model.norm(h)))
    return logits, st


def whole_prefill(model: Model, tokens: mx.array) -> tuple[mx.array, float]:
    """One unstaged prefill call into a fresh cache: (logits, seconds)."""
    cache = model.make_cache()
    t0 = time.perf_counter()
    logits = model(tokens, cache=cache)
    mx.eval(logits, [a for c in cache for a in c.state if a is not None])
    return logits, time.perf_counter() - t0


def gemm_probe(a: mx.array, w: mx.array):
    """() -> FLOP/s of one evaluated ``a @ w`` (a: [m, k], w: [k, n])."""
    flops = 2.0 * a.shape[0] * a.shape[1] * w.shape[1]

    def probe() -> float:
        t0 = time.perf_counter()
        mx.eval(a @ w)
        return flops / (time.perf_counter() - t0)

    return probe


# ------------------------------------------------------------------------------------------------- main
ROW_ORDER = [
    "KDA projections", "KDA short conv", "KDA gates (L2 norm, decay, beta)", "KDA scan", "KDA output norm * gate",
    "KDA o_proj", "MLA projections", "MLA attention", "MLA output gate", "MLA o_proj", "MoE router",
    "MoE routed experts", "MoE shared expert", "dense MLP", "head (norm + lm_head)", "norms, residuals, embedding",
]  # fmt: skip


def layer_counts(model: Model) -> dict[str, int]:
    """How many layers each row's module appears in (its FLOPs are per layer)."""
    n = defaultdict(int)
    for layer in model.layers:
        names = [r for r in ROW_ORDER if r.startswith("KDA" if layer.is_linear else "MLA")]
        names += [r for r in ROW_ORDER if r.startswith("MoE")] if "switch_mlp" in layer.mlp else ["dense MLP"]
        for r in names:
            n[r] += 1
    n["head (norm + lm_head)"] = 1
    return n


def _untiled_mla():
    """MLA expanded prefill attention with one query block of all the chunk's rows (every key block attended by every
    query, the causal mask over the chunk's whole T x T diagonal)."""
    from kimi_mlx.ops import mla_attention

    return mla_attention, "QUERY_BLOCK", 1 << 30


def _copied_experts():
    """The sorted MoE path reading each expert's weights by integer indexing (a copy per call)."""
    from kimi_mlx.layers import moe

    return moe, "expert_view", lambda stack, e: stack[e]


def _sorted_loop_on_gpu():
    """Routed experts on a GPU through the per-expert loop (``sorted_switch_glu``) from ``SORTED_MIN_PAIRS`` pairs on,
    not SwitchGLU's segmented ``gather_mm``; on the CPU backend this is the current behaviour."""
    from kimi_mlx.layers import moe

    return moe, "_segmented_gather", lambda switch: False


def _uncompiled_kda_output_norm():
    """The KDA output RMSNorm * sigmoid gate as an uncompiled graph."""
    return kda_layer, "gated_rms_norm", kda_layer._gated_rms_norm


BASELINES = {  # --baseline NAME: (object, attribute, replacement), or a list of them, restoring an earlier behaviour
    "kda-uncompiled-output-norm": _uncompiled_kda_output_norm,
    "mla-untiled": _untiled_mla,
    "moe-copied-experts": _copied_experts,
    "moe-sorted-loop-on-gpu": _sorted_loop_on_gpu,
}


class Variant:
    """One configuration's measurements over the repeats."""

    def __init__(self, name: str, patch=None):
        self.name, self.patch = name, patch
        self.times, self.cpu, self.shares = defaultdict(list), defaultdict(list), defaultdict(list)

    def run(self, model, tokens, probe, flops: dict, flops_all: float) -> tuple[mx.array, mx.array]:
        """One staged forward, then one whole prefill between two probes; returns (staged, whole) logits."""
        patches = self.patch() if self.patch else []
        patches = [patches] if isinstance(patches, tuple) else patches
        undo = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
        for obj, attr, repl in patches:
            setattr(obj, attr, repl)
        try:
            staged_logits, st = staged_forward(model, tokens, probe)
            r0 = probe()
            c0 = time.process_time()
            logits, t_whole = whole_prefill(model, tokens)
            c_whole = time.process_time() - c0
            r1 = probe()
        finally:
            for u in undo:
                setattr(*u)
        self.last = (st, t_whole, c_whole, (r0 + r1) / 2)
        return staged_logits, logits

    def record(self, flops: dict, flops_all: float) -> None:
        st, t_whole, c_whole, rate = self.last
        for k, v in st.times.items():
            self.times[k].append(v)
            self.cpu[k].append(st.cpu[k])
            self.shares[k].append(flops.get(k, 0.0) / st.gemm_flops[k])
        self.times["staged total"].append(sum(st.times.values()))
        self.cpu["staged total"].append(sum(st.cpu.values()))
        self.shares["staged total"].append(flops_all / sum(st.gemm_flops.values()))
        self.times["whole-model prefill"].append(t_whole)
        self.cpu["whole-model prefill"].append(c_whole)
        self.shares["whole-model prefill"].append(flops_all / (t_whole * rate))

    def table(self, flops: dict, flops_all: float, counts: dict) -> None:
        total = statistics.median(self.times["staged total"])
        print(f"\n{self.name}:")
        print("| module (layers) | ms | spread ms | CPU ms | % of staged | GFLOP | GFLOP/s "
              "| share of GEMM rate (spread) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for row in ROW_ORDER + ["staged total", "whole-model prefill"]:
            if row not in self.times:
                continue
            v, sh = self.times[row], self.shares[row]
            f = flops.get(row, flops_all)
            med = statistics.median(v)
            rate = f"{f / med / 1e9:.1f}" if f else "-"
            share = f"{100 * statistics.median(sh):.0f}% ({100 * min(sh):.0f}-{100 * max(sh):.0f})" if f else "-"
            pct = "" if row == "whole-model prefill" else f"{100 * med / total:.1f}%"
            n = f" ({counts[row]})" if row in counts else ""
            print(f"| {row}{n} | {med * 1e3:.0f} | {min(v) * 1e3:.0f}-{max(v) * 1e3:.0f} | "
                  f"{statistics.median(self.cpu[row]) * 1e3:.0f} | {pct} | {f / 1e9:.2f} | {rate} | {share} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["real", "narrow"], default="real")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median) after one warm-up")
    ap.add_argument("--baseline", choices=sorted(BASELINES),
                    help="also run an earlier behaviour (interleaved with the current one in every repeat) and print "
                         "the ratio current / baseline per module")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("KIMI_BENCH_CACHE", Path.home() / ".cache" / "kimi_mlx_bench")))
    args = ap.parse_args(argv)

    print(f"BLAS: {blas_in_use()}")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, CPUs {os.cpu_count()}, float32, {args.tokens} tokens, "
          f"{args.repeats} repeats after 1 warm-up, GEMM / staged / whole interleaved in each repeat")
    t0 = time.perf_counter()
    if args.model == "real":
        config, model = REAL_WIDTH, random_model(REAL_WIDTH)
    else:
        config = CONFIG
        model = load_kimi(checkpoint_dir(args.cache_dir), mx.float32)
    cfg = model.args
    print(f"model {args.model}: {describe(config)} ({time.perf_counter() - t0:.1f}s to build)")
    T, hidden = args.tokens, cfg.hidden_size
    tokens = mx.random.randint(0, cfg.vocab_size, (1, T), key=mx.random.key(3))
    w = mx.random.normal((hidden, GEMM_OUT), key=mx.random.key(5)) * hidden**-0.5
    a = mx.random.normal((T, hidden), key=mx.random.key(4))
    full, probe = gemm_probe(a, w), gemm_probe(a[: min(T, PROBE_ROWS)], w)
    mx.eval(tokens, a, w)
    counts = layer_counts(model)
    flops = {r: module_flops(cfg, T, r) * counts.get(r, 0) for r in ROW_ORDER}
    flops_all = sum(flops.values())

    variants = [Variant("current")]
    if args.baseline:
        variants.insert(0, Variant(f"baseline {args.baseline}", BASELINES[args.baseline]))
    gemm = []
    for i in range(args.repeats + 1):  # repeat 0: warm-up
        g = statistics.median(full() for _ in range(3))
        outs = {}
        for v in variants if i % 2 else variants[::-1]:
            staged_logits, outs[v.name] = v.run(model, tokens, probe, flops, flops_all)
            if i == 0:
                diff = mx.abs(staged_logits - outs[v.name]).max().item()
                print(f"{v.name}: staged vs whole forward: max |logit diff| {diff:.2e} (max |logit| "
                      f"{mx.abs(staged_logits).max().item():.1f})")
            else:
                v.record(flops, flops_all)
        if i == 0 and len(variants) > 1:
            a_, b_ = (outs[v.name] for v in variants)
            print(f"current vs baseline: max |logit diff| {mx.abs(a_ - b_).max().item():.2e}")
        if i:
            gemm.append(g)
            print(f"  repeat {i}: GEMM {g / 1e9:.0f} GFLOP/s; " + "; ".join(
                f"{v.name}: staged {v.times['staged total'][-1]:.2f} s, "
                f"whole {v.times['whole-model prefill'][-1]:.2f} s" for v in variants), flush=True)

    print(f"\nGEMM rate: {statistics.median(gemm) / 1e9:.1f} GFLOP/s ([{T}, {hidden}] x [{hidden}, {GEMM_OUT}] "
          f"float32, "
          f"median of 3 per repeat; repeats {min(gemm) / 1e9:.0f}-{max(gemm) / 1e9:.0f}); each module's share is "
          f"against the probe ([{min(T, PROBE_ROWS)}, {hidden}] x [{hidden}, {GEMM_OUT}]) run just before it")
    for v in variants:
        v.table(flops, flops_all, counts)
    if len(variants) > 1:
        base, cur = variants
        print("\ncurrent / baseline (median of the per-repeat ratios; wall and CPU time):")
        print("| module | baseline ms | current ms | wall ratio | CPU ratio |")
        print("|---|---:|---:|---:|---:|")
        for row in ROW_ORDER + ["staged total", "whole-model prefill"]:
            if row in cur.times and row in base.times:
                wr = statistics.median(c / b for c, b in zip(cur.times[row], base.times[row]))
                cr = statistics.median(c / b for c, b in zip(cur.cpu[row], base.cpu[row]))
                print(f"| {row} | {statistics.median(base.times[row]) * 1e3:.0f} | "
                      f"{statistics.median(cur.times[row]) * 1e3:.0f} | {wr:.2f} | {cr:.2f} |")
    T_whole = statistics.median(variants[-1].times["whole-model prefill"])
    print(f"\nwhole-model prefill (current): {T / T_whole:.1f} tok/s")
    return 0

if __name__ == "__main__":
    sys.exit(main())
