"""kimi-mlx vs mlx-lm on the same random Kimi Linear checkpoint: prefill / decode tok/s and peak memory.

Builds a small but realistically shaped Kimi Linear (3:1 KDA:MLA, last layer MLA, KDA head_dim 128, sigmoid-routed
MoE with a shared expert), writes it ONCE as an HF checkpoint in Moonshot's original key layout (bf16 matrices,
float32 A_log / dt_bias / convs / router bias, like the released model) into a cache dir, loads the same weights
in both implementations and prints a side-by-side table. See bench/README.md for how to run it (and with which BLAS).

    python bench/bench_vs_mlx_lm.py                      # float32, prefill 512/2048, decode after 512
    python bench/bench_vs_mlx_lm.py --sizes 512 2048 8192 --dtype bf16 --profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

PREFILL_STEP = 2048  # mlx-lm's default prefill_step_size; both sides process the prompt in chunks of this size

CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 8192,
    "hidden_size": 768,
    "intermediate_size": 1536,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "head_dim": 72,
    "kv_lora_rank": 256,
    "q_lora_rank": None,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "mla_use_nope": True,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "num_expert_group": 1,
    "topk_group": 1,
    "use_grouped_topk": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "model_max_length": 1048576,
    "initializer_range": 0.02,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
        "head_dim": 128,
        "num_heads": 6,
        "short_conv_kernel_size": 4,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
SEED = 20251


# ----------------------------------------------------------------------------------------------- checkpoint
def make_checkpoint(cfg: dict, seed: int = SEED) -> dict[str, np.ndarray]:
    """Random weights in Moonshot's original layout (float32 numpy; matrices are stored as bf16 later).

    ``cfg`` is a Kimi Linear config or a Kimi-K3 ``text_config``: the K3 fields (``q_lora_rank``,
    ``mla_use_output_gate``, ``use_full_rank_gate``, ``routed_expert_hidden_size``, ``latent_moe_use_norm``,
    ``attn_res_block_size``) add their tensors; without them the random draws are exactly the Kimi Linear ones.
    Keys have no ``language_model.`` prefix and ``A_log`` is ``[1, 1, H, 1]`` (the K3 bench re-lays them out)."""
    rng = np.random.default_rng(seed)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    lac = cfg["linear_attn_config"]
    nh, hd, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = nh * hd
    E, MI = cfg["num_experts"], cfg["moe_intermediate_size"]
    mh, r = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    W = cfg.get("routed_expert_hidden_size") or H  # routed experts' width (K3 latent MoE)
    attn_res = cfg.get("attn_res_block_size") is not None
    w: dict[str, np.ndarray] = {}

    def lin(name, out_f, in_f, gain=1.0):
        w[name] = (rng.standard_normal((out_f, in_f), dtype=np.float32) * (gain / np.sqrt(in_f))).astype(np.float32)

    def norm(name, n):
        w[name] = (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32)

    w["model.embed_tokens.weight"] = rng.standard_normal((V, H), dtype=np.float32)
    lin("lm_head.weight", V, H)
    norm("model.norm.weight", H)
    if attn_res:
        norm("model.output_attn_res_norm.weight", H)
        lin("model.output_attn_res_proj.weight", 1, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", H)
        norm(f"{p}.post_attention_layernorm.weight", H)
        if attn_res:
            for res in ("self_attention_res", "mlp_res"):
                norm(f"{p}.{res}_norm.weight", H)
                lin(f"{p}.{res}_proj.weight", 1, H)
        a = f"{p}.self_attn"
        if i + 1 in lac["kda_layers"]:
            for n in "qkv":
                lin(f"{a}.{n}_proj.weight", P, H)
                w[f"{a}.{n}_conv1d.weight"] = (rng.standard_normal((P, 1, K)) * 0.5).astype(np.float32)
            lin(f"{a}.f_a_proj.weight", hd, H)
            lin(f"{a}.f_b_proj.weight", P, hd)
            lin(f"{a}.b_proj.weight", nh, H)
            if lac.get("use_full_rank_gate"):
                lin(f"{a}.g_proj.weight", P, H)
            else:
                lin(f"{a}.g_a_proj.weight", hd, H)
                lin(f"{a}.g_b_proj.weight", P, hd)
            w[f"{a}.A_log"] = np.log(rng.uniform(1.0, 20.0, (1, 1, nh, 1))).astype(np.float32)
            w[f"{a}.dt_bias"] = (rng.standard_normal(P) * 0.5 - 2.0).astype(np.float32)
            norm(f"{a}.o_norm.weight", hd)
            lin(f"{a}.o_proj.weight", H, P, gain=0.5)
        else:
            if cfg.get("q_lora_rank"):
                lin(f"{a}.q_a_proj.weight", cfg["q_lora_rank"], H)
                norm(f"{a}.q_a_layernorm.weight", cfg["q_lora_rank"])
                lin(f"{a}.q_b_proj.weight", mh * (nope + rope), cfg["q_lora_rank"])
            else:
                lin(f"{a}.q_proj.weight", mh * (nope + rope), H)
            lin(f"{a}.kv_a_proj_with_mqa.weight", r + rope, H)
            norm(f"{a}.kv_a_layernorm.weight", r)
            lin(f"{a}.kv_b_proj.weight", mh * (nope + vd), r)
            lin(f"{a}.o_proj.weight", H, mh * vd, gain=0.5)
            if cfg.get("mla_use_output_gate"):
                lin(f"{a}.g_proj.weight", mh * vd, H)
        if cfg["num_experts"] and i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
            m = f"{p}.block_sparse_moe"
            for e in range(E):
                lin(f"{m}.experts.{e}.w1.weight", MI, W)
                lin(f"{m}.experts.{e}.w2.weight", W, MI, gain=0.5)
                lin(f"{m}.experts.{e}.w3.weight", MI, W)
            lin(f"{m}.gate.weight", E, H)
            w[f"{m}.gate.e_score_correction_bias"] = (rng.standard_normal(E) * 0.05).astype(np.float32)
            if W != H:
                lin(f"{m}.routed_expert_down_proj.weight", W, H)
                lin(f"{m}.routed_expert_up_proj.weight", H, W)
                if cfg.get("latent_moe_use_norm"):
                    norm(f"{m}.routed_expert_norm.weight", W)
            SI = MI * cfg["num_shared_experts"]
            lin(f"{m}.shared_experts.gate_proj.weight", SI, H)
            lin(f"{m}.shared_experts.up_proj.weight", SI, H)
            lin(f"{m}.shared_experts.down_proj.weight", H, SI, gain=0.5)
        else:
            lin(f"{p}.mlp.gate_proj.weight", I, H)
            lin(f"{p}.mlp.up_proj.weight", I, H)
            lin(f"{p}.mlp.down_proj.weight", H, I, gain=0.5)
    return w


KEEP_F32 = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias")  # stored float32; other tensors bf16


def checkpoint_dir(root: Path, config: dict = CONFIG, make=make_checkpoint, name: str = "kimi_linear_bench",
                   seed: int = SEED, keep_f32: tuple[str, ...] = KEEP_F32) -> Path:
    """Write ``make(config, seed)`` (float32 numpy arrays; names ending in ``keep_f32`` stay float32, the rest is
    stored bf16) with ``config.json`` once, keyed by config + seed, and return its directory."""
    import hashlib

    key = hashlib.sha1(json.dumps([config, seed], sort_keys=True).encode()).hexdigest()[:10]
    path = root / f"{name}_{key}"
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    arrays = {
        k: mx.array(v) if k.endswith(keep_f32) else mx.array(v).astype(mx.bfloat16)
        for k, v in make(config, seed).items()
    }
    tmp = path / "model.tmp.safetensors"
    mx.save_safetensors(str(tmp), arrays, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(path / "model.safetensors")
    return path


# ------------------------------------------------------------------------------------------------- loading
def load_kimi(path: Path, dtype):
    from kimi_mlx.loading import load_model

    model, _ = load_model(path, dtype=dtype)
    return model


def load_mlx_lm(path: Path, dtype):
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    if dtype == mx.float32:
        model.set_dtype(mx.float32)
    model.eval()
    mx.eval(model.parameters())
    return model


# ------------------------------------------------------------------------------------------------- timing
def blas_in_use() -> str:
    """Which library MLX's ``cblas_sgemm`` binds to: one preloaded into the global scope (LD_PRELOAD) wins over the
    wheel's bundled reference BLAS. (numpy's own OpenBLAS uses suffixed symbols and is ignored.)"""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    lib = None
    try:
        glob = ctypes.CDLL(None)
        fn = glob.cblas_sgemm
        info = DlInfo()
        if glob.dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)):
            lib = os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):
        pass
    maps = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "blas" in ln.lower() and "/" in ln})
    if lib is None:  # not in the global scope: libmlx uses its own dependency
        lib = next((m for m in maps if "mlx_cpu.libs" in m), "?")
    if "openblas" in lib.lower():
        return f"OpenBLAS ({lib})"
    return f"bundled reference BLAS ({lib}) -- slow; see bench/README.md for OpenBLAS via LD_PRELOAD"


def prefill(model, tokens: mx.array, cache) -> mx.array:
    """Process the prompt in chunks of PREFILL_STEP (mlx-lm's default), evaluating the cache after each chunk."""
    T = tokens.shape[1]
    for s in range(0, T, PREFILL_STEP):
        logits = model(tokens[:, s : s + PREFILL_STEP], cache=cache)
        mx.eval(logits, [a for c in cache for a in c.state if a is not None])
    return logits


def greedy_decode(model, tok: mx.array, cache, steps: int) -> mx.array:
    """``steps`` greedy one-token steps from ``tok`` [B], evaluated each step (as a streaming generator does)."""
    for _ in range(steps):
        logits = model(tok[:, None], cache=cache)
        tok = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(tok)
    return tok


def prefill_once(model, tokens: mx.array) -> tuple[float, int]:
    """One prefill of ``tokens`` into a fresh cache: (tokens/s, peak bytes)."""
    cache = model.make_cache()
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    prefill(model, tokens, cache)
    return tokens.shape[1] / (time.perf_counter() - t0), mx.get_peak_memory()


def decode_once(model, tokens: mx.array, steps: int) -> tuple[float, int]:
    """Prefill ``tokens``, then ``steps`` greedy decode steps timed: (tokens/s, peak bytes during decode)."""
    cache = model.make_cache()
    logits = prefill(model, tokens, cache)
    tok = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(tok)
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    greedy_decode(model, tok, cache, steps)
    return steps / (time.perf_counter() - t0), mx.get_peak_memory()


def interleaved(models: dict, measure, runs: int) -> tuple[dict, dict]:
    """``runs`` rounds (after one warm-up round) of ``measure(model)`` alternating between the implementations, so
    both see the same machine load: ({name: [rates]}, {name: peak bytes})."""
    rates, peaks = {n: [] for n in models}, {n: 0 for n in models}
    for i in range(runs + 1):  # round 0 = warm-up (shape-specialised compiles)
        for name, model in models.items():
            rate, peak = measure(model)
            peaks[name] = max(peaks[name], peak)
            if i:
                rates[name].append(rate)
    return rates, peaks


def parity(kimi, ref, vocab: int, T: int = 24):
    """Max |logit diff| on a short prompt (prefill) and on 4 greedy decode steps; same tokens fed to both."""
    tokens = mx.random.randint(0, vocab, (1, T), key=mx.random.key(1))
    ck, cr = kimi.make_cache(), ref.make_cache()
    a, b = kimi(tokens, cache=ck), ref(tokens, cache=cr)
    pre = mx.abs(a - b).max().item()
    scale = mx.abs(b).max().item()
    dec = 0.0
    tok = mx.argmax(b[:, -1], axis=-1)
    for _ in range(4):
        a, b = kimi(tok[:, None], cache=ck), ref(tok[:, None], cache=cr)
        dec = max(dec, mx.abs(a - b).max().item())
        tok = mx.argmax(b[:, -1], axis=-1)
    return pre, dec, scale


# ------------------------------------------------------------------------------------------------- profile
class _Timer:
    """Wraps a function: evaluates its inputs, times it to evaluated outputs, accumulates per name."""

    def __init__(self):
        self.acc: dict[str, float] = {}

    def wrap(self, name, fn):
        def inner(*args, **kwargs):
            mx.eval([a for a in args if isinstance(a, mx.array)])
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(out)
            self.acc[name] = self.acc.get(name, 0.0) + time.perf_counter() - t0
            return out

        return inner


def profile_targets(which: str, k3: bool = False) -> list[tuple[object, str, str]]:
    """The (object, attribute, row name) functions ``profile`` times, per implementation; ``k3`` for Kimi-K3 (mlx-lm's
    ``kimi_k3`` classes, or mlx-vlm's ``kimi_k3.language`` ones, plus the AttnRes mix)."""
    if which == "kimi-mlx":
        import kimi_mlx.layers.kda as kda_layer
        import kimi_mlx.layers.moe as moe_layer
        from kimi_mlx.layers.mla import KimiMLA
        from kimi_mlx.layers.residual import ResidualMix

        scan, experts, ml = (kda_layer, "kda_gated"), (moe_layer, "switch_glu"), None
        classes = (kda_layer.KimiDeltaAttention, KimiMLA, moe_layer.SparseMoE, moe_layer.MLP)
        res_mix = (ResidualMix, "__call__")
    elif which == "mlx-vlm":
        from mlx_vlm.models.kimi_k3 import language as ml
        from mlx_vlm.models.switch_layers import SwitchGLU

        scan, experts = (ml, "gated_delta_update"), (SwitchGLU, "__call__")
        classes = tuple(getattr(ml, "KimiK3" + n) for n in ("DeltaAttention", "MLAAttention", "SparseMoE", "MLP"))
        res_mix = (ml, "_attn_res_mix")
    else:
        import importlib

        from mlx_lm.models.switch_layers import SwitchGLU

        ml = importlib.import_module("mlx_lm.models.kimi_k3" if k3 else "mlx_lm.models.kimi_linear")
        prefix = "KimiK3" if k3 else "Kimi"
        scan, experts = (ml, "gated_delta_update"), (SwitchGLU, "__call__")
        classes = tuple(getattr(ml, prefix + n) for n in ("DeltaAttention", "MLAAttention", "SparseMoE", "MLP"))
        res_mix = (ml, "_attn_res_mix")
    rows = [(*scan, f"KDA scan ({scan[1]})"), (*experts, "routed experts")]
    names = ("KDA layer (all)", "MLA layer", "MoE block (all)", "MLP (dense + shared experts)")
    rows += [(cls, "__call__", name) for cls, name in zip(classes, names)]
    return rows + [(*res_mix, "AttnRes mix")] if k3 else rows


def profile(which: str, model, T: int, decode_steps: int, vocab: int, targets) -> list[str]:
    """Split one prefill of T tokens and decode_steps decode steps into the components ``targets`` names
    (``(object, attribute, row name)``; each forced to evaluate on its own, so the total is a bit above the
    unprofiled time)."""
    timer = _Timer()
    patches = []
    for obj, attr, name in targets:
        orig = getattr(obj, attr)
        setattr(obj, attr, timer.wrap(name, orig))
        patches.append((obj, attr, orig))
    lines = []
    try:
        for phase in ("prefill", "decode"):
            tokens = mx.random.randint(0, vocab, (1, T), key=mx.random.key(3))
            cache = model.make_cache()
            logits = prefill(model, tokens, cache)  # warm-up
            cache = model.make_cache()
            tok = mx.argmax(logits[:, -1], axis=-1)
            timer.acc.clear()
            t0 = time.perf_counter()
            if phase == "prefill":
                prefill(model, tokens, cache)
            else:
                prefill(model, tokens, cache)
                timer.acc.clear()
                t0 = time.perf_counter()
                greedy_decode(model, tok, cache, decode_steps)
            total = time.perf_counter() - t0
            parts = ", ".join(f"{k} {v:.2f}s ({100 * v / total:.0f}%)" for k, v in sorted(timer.acc.items(),
                                                                                        key=lambda kv: -kv[1]))
            what = f"prefill {T}" if phase == "prefill" else f"{decode_steps} decode steps after {T}"
            lines.append(f"  {which:8s} {what}: total {total:.2f}s; {parts}")
    finally:
        for obj, attr, orig in reversed(patches):
            setattr(obj, attr, orig)
    return lines


# ---------------------------------------------------------------------------------------------------- main
def parse_args(doc: str, argv=None, anchors: tuple[str, ...] = ("mlx-lm",)) -> argparse.Namespace:
    """The options; ``anchors``: the implementations ``--anchor`` may name (the first is the default)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048], help="prefill lengths (add 8192 if patient)")
    ap.add_argument("--dtype", choices=["float32", "bf16"], default="float32")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per measurement (median), after 1 warm-up")
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="also print a per-component time split (2048 prefill)")
    ap.add_argument("--anchor", choices=anchors, default=anchors[0], help="the implementation compared with")
    ap.add_argument("--only", choices=["kimi-mlx", *anchors], help="benchmark one implementation only")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("KIMI_BENCH_CACHE", Path.home() / ".cache" / "kimi_mlx_bench")))
    return ap.parse_args(argv)


def describe(c: dict) -> str:
    """One line on the model's shape (Kimi Linear config or K3 text_config)."""
    lac = c["linear_attn_config"]
    return (f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers (KDA {len(lac['kda_layers'])} x "
            f"{lac['num_heads']}h x {lac['head_dim']}, MLA at {lac['full_attn_layers']}), {c['num_experts']} experts "
            f"top-{c['num_experts_per_token']} x {c['moe_intermediate_size']} + {c['num_shared_experts']} shared, "
            f"vocab {c['vocab_size']}")


def run(args: argparse.Namespace, make_path, text_config: dict, targets, note: str = "", loaders=None) -> int:
    """The benchmark: BLAS line, checkpoint (``make_path()`` -> its directory), parity, prefill/decode table and,
    with ``--profile``, the split over ``targets(which)`` (see ``profile``). ``loaders``: {anchor name:
    load(path, dtype)} (default mlx-lm's); ``args.anchor`` names the one that runs."""
    anchor = args.anchor
    load_anchor = (loaders or {"mlx-lm": load_mlx_lm})[anchor]
    dtype = mx.float32 if args.dtype == "float32" else mx.bfloat16  # bf16: matrices bf16, gates stay float32

    print(f"BLAS: {blas_in_use()}")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, CPUs {os.cpu_count()}, dtype {args.dtype}, "
          f"prompt processed in chunks of {PREFILL_STEP} (mlx-lm's default prefill step), {args.runs} rounds after "
          f"1 warm-up round, implementations alternating within each round")
    t0 = time.perf_counter()
    path = make_path()
    print(f"checkpoint: {path} ({time.perf_counter() - t0:.1f}s); {describe(text_config)}{note}")
    vocab = text_config["vocab_size"]

    models = {}
    if args.only in (None, "kimi-mlx"):
        models["kimi-mlx"] = load_kimi(path, dtype)
    if args.only in (None, anchor):
        models[anchor] = load_anchor(path, dtype)
    if len(models) == 2:
        pre, dec, scale = parity(models["kimi-mlx"], models[anchor], vocab)
        print(f"logit parity (24-token prompt, then 4 decode steps): max |diff| prefill {pre:.2e}, decode {dec:.2e} "
              f"(max |logit| {scale:.1f})")

    rows = []  # (metric, {impl: [values per round]})
    for T in args.sizes:
        tokens = mx.random.randint(0, vocab, (1, T), key=mx.random.key(T))
        rates, peaks = interleaved(models, lambda m: prefill_once(m, tokens), args.runs)
        for name in models:
            print(f"  {name:8s} prefill {T:5d}: {statistics.median(rates[name]):8.1f} tok/s  runs "
                  f"{[round(r, 1) for r in rates[name]]}", flush=True)
        rows.append((f"prefill {T} (tok/s)", rates))
        rows.append((f"  peak mem prefill {T} (GiB)", {n: [p / 2**30] for n, p in peaks.items()}))
    tokens = mx.random.randint(0, vocab, (1, args.decode_prompt), key=mx.random.key(7))
    rates, peaks = interleaved(models, lambda m: decode_once(m, tokens, args.decode_steps), args.runs)
    for name in models:
        print(f"  {name:8s} decode: {statistics.median(rates[name]):8.2f} tok/s  runs "
              f"{[round(r, 2) for r in rates[name]]}", flush=True)
    rows.append((f"decode after {args.decode_prompt} (tok/s, {args.decode_steps} steps)", rates))
    rows.append(("  peak mem decode (GiB)", {n: [p / 2**30] for n, p in peaks.items()}))

    names = list(models)
    print()
    header = f"| {'metric':46s} | " + " | ".join(f"{n:>9s}" for n in names)
    header += f" | {'kimi-mlx / ' + anchor:>17s} |" if len(names) == 2 else " |"
    print("(values: medians over the rounds; ratio: median of the per-round ratios, each round ran both back to back)")
    print(header)
    print("|" + "-" * 48 + "|" + "|".join("-" * 11 for _ in names) + ("|" + "-" * 19 + "|" if len(names) == 2 else "|"))
    for metric, vals in rows:
        line = f"| {metric:46s} | " + " | ".join(f"{statistics.median(vals[n]):9.2f}" for n in names)
        if len(names) == 2:
            ratio = statistics.median(k / m for k, m in zip(vals["kimi-mlx"], vals[anchor]))
            line += f" | {ratio:16.2f}x |"
        else:
            line += " |"
        print(line)
    if args.profile:
        print("\nprofile (each component forced to evaluate separately; 'all' rows include their inner rows):")
        for name, model in models.items():
            for line in profile(name, model, min(2048, max(args.sizes)), args.decode_steps, vocab, targets(name)):
                print(line, flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    return run(args, lambda: checkpoint_dir(args.cache_dir), CONFIG, profile_targets)


if __name__ == "__main__":
    sys.exit(main())
