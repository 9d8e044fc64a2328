"""Load time and peak RSS of ``kimi_mlx.load("file.gguf")`` on a multi-GB Kimi Linear GGUF.

The issue's target: peak resident memory while loading <= 1.3x the GGUF's size. No public Kimi GGUF fits
a 24 GB CI machine, so this writes a realistically *mixed* file (like llama.cpp's Q4_K_M): routed experts
Q4_K, attention / shared-expert / dense / embedding matrices Q8_0, small tensors F32, on a scaled-up
Kimi Linear schedule (metadata and tokenizer taken from the llama.cpp tiny fixture, sizes overridden).
Tensor data are random but well-formed blocks (finite fp16 scales), streamed to disk tensor by tensor.

Each load runs in a fresh subprocess that reports its own ``ru_maxrss`` (peak RSS, which includes file pages
read through the memory map), the load's wall time and MLX's peak memory.

    python bench/bench_gguf_load.py                  # ~2.1 GB file under ~/.cache/kimi_mlx_bench
    python bench/bench_gguf_load.py --experts 128    # ~4 GB
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "llamacpp" / "kimi_linear"
Q = gguf.GGMLQuantizationType


def shapes(a) -> dict[str, tuple[tuple[int, ...], Q]]:
    """GGUF tensor name -> (numpy-order shape, type) for the scaled Kimi Linear of ``a``."""
    E, H, D, K, R, Dr, nope, Dv = a.hidden, a.heads, 128, 4, 512, 64, 128, 128
    X, Fe, F = a.experts, a.expert_ff, 4 * a.hidden
    out = {"token_embd.weight": ((512, E), Q.Q8_0), "output.weight": ((512, E), Q.Q8_0),
           "output_norm.weight": ((E,), Q.F32)}
    for i in range(a.layers):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = ((E,), Q.F32)
        out[b + "ffn_norm.weight"] = ((E,), Q.F32)
        if i % 4 == 3:  # MLA
            out.update({
                b + "attn_q.weight": ((H * (nope + Dr), E), Q.Q8_0), b + "attn_kv_a_mqa.weight": ((R + Dr, E), Q.Q8_0),
                b + "attn_kv_a_norm.weight": ((R,), Q.F32), b + "attn_k_b.weight": ((H, R, nope), Q.F32),
                b + "attn_v_b.weight": ((H, Dv, R), Q.F32), b + "attn_output.weight": ((E, H * Dv), Q.Q8_0),
            })
        else:  # KDA
            out.update({
                b + "attn_q.weight": ((H * D, E), Q.Q8_0), b + "attn_k.weight": ((H * D, E), Q.Q8_0),
                b + "attn_v.weight": ((H * D, E), Q.Q8_0), b + "attn_output.weight": ((E, H * D), Q.Q8_0),
                b + "ssm_a": ((1, 1, H, 1), Q.F32), b + "ssm_beta.weight": ((H, E), Q.F32),
                b + "ssm_dt.bias": ((H * D,), Q.F32), b + "ssm_norm.weight": ((D,), Q.F32),
                b + "ssm_f_a.weight": ((D, E), Q.F32), b + "ssm_f_b.weight": ((H * D, D), Q.F32),
                b + "ssm_g_a.weight": ((D, E), Q.F32), b + "ssm_g_b.weight": ((H * D, D), Q.F32),
                **{b + f"ssm_conv1d_{c}.weight": ((1, H * D, 1, K), Q.F32) for c in "qkv"},
            })
        if i == 0:  # leading dense block
            out.update({b + "ffn_gate.weight": ((F, E), Q.Q8_0), b + "ffn_up.weight": ((F, E), Q.Q8_0),
                        b + "ffn_down.weight": ((E, F), Q.Q8_0)})
        else:
            out.update({
                b + "ffn_gate_inp.weight": ((X, E), Q.F32), b + "exp_probs_b.bias": ((X,), Q.F32),
                b + "ffn_gate_exps.weight": ((X, Fe, E), Q.Q4_K), b + "ffn_up_exps.weight": ((X, Fe, E), Q.Q4_K),
                b + "ffn_down_exps.weight": ((X, E, Fe), Q.Q4_K),
                b + "ffn_gate_shexp.weight": ((Fe, E), Q.Q8_0), b + "ffn_up_shexp.weight": ((Fe, E), Q.Q8_0),
                b + "ffn_down_shexp.weight": ((E, Fe), Q.Q8_0),
            })
    return out


def metadata(a) -> dict[str, tuple]:
    """Overrides of the fixture's ``kimi-linear.*`` keys: value, value type, array element type."""
    U, F32, ARR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.ARRAY
    p = "kimi-linear."
    return {
        p + "block_count": (a.layers, U, None), p + "embedding_length": (a.hidden, U, None),
        p + "feed_forward_length": (4 * a.hidden, U, None), p + "attention.head_count": (a.heads, U, None),
        p + "attention.head_count_kv": ([int(i % 4 == 3) for i in range(a.layers)], ARR, U),
        p + "expert_count": (a.experts, U, None), p + "expert_used_count": (8, U, None),
        p + "attention.key_length": (512 + 64, U, None), p + "attention.value_length": (512, U, None),
        p + "kda.head_dim": (128, U, None), p + "attention.kv_lora_rank": (512, U, None),
        p + "rope.dimension_count": (64, U, None), p + "attention.key_length_mla": (192, U, None),
        p + "attention.value_length_mla": (128, U, None), p + "expert_feed_forward_length": (a.expert_ff, U, None),
        p + "expert_weights_scale": (2.446, F32, None),
    }


def block_data(name: str, shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random, well-formed tensor data: float32 values, or quant blocks with finite scales, as uint8 rows."""
    if name.endswith("ssm_a"):  # the converter stores -exp(A_log) < 0
        return -np.exp(rng.uniform(0.0, 2.7, shape)).astype(np.float32)
    if qtype == Q.F32:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    raw = rng.integers(0, 256, (rows, shape[-1] // block, nbytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
    raw[..., 0:2] = scale  # Q8_0 d / Q4_K d
    if qtype == Q.Q4_K:
        raw[..., 2:4] = scale  # dmin
    return raw.reshape(*shape[:-1], -1)


def write_gguf(path: Path, a) -> None:
    template = gguf.GGUFReader(str(next(FIXTURE.glob("*-F32.gguf"))))
    w = gguf.GGUFWriter(str(path), "kimi-linear")
    meta = metadata(a)
    for key, field in template.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in meta:
            w.add_key_value(key, *meta[key])
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    plan = shapes(a)
    rng = np.random.default_rng(0)
    for name, (shape, qtype) in plan.items():
        if qtype == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * nbytes)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, (shape, qtype) in plan.items():
        w.write_tensor_data(block_data(name, shape, qtype, rng))
    w.close()


def child(path: str, scales: str) -> None:
    import mlx.core as mx

    import kimi_mlx

    t0 = time.perf_counter()
    dtype = getattr(mx, scales)  # compact scales come with a model in that dtype (mixed dtypes would upcast)
    model, tok = kimi_mlx.load(path, dtype=dtype, gguf_scale_dtype=dtype)
    mx.eval(model.parameters())
    seconds = time.perf_counter() - t0
    logits = model(mx.array([tok.encode("hello world")]))
    mx.eval(logits)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # B / KiB
    print(json.dumps({"seconds": seconds, "rss": rss, "mlx_peak": mx.get_peak_memory(),
                      "finite": bool(mx.isfinite(logits).all())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--expert-ff", type=int, default=768)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cache-dir", default=os.environ.get("KIMI_BENCH_CACHE", "~/.cache/kimi_mlx_bench"))
    ap.add_argument("--scales", nargs="+", default=["float32", "float16"], choices=("float32", "float16", "bfloat16"),
                    help="GGUF scale dtypes to measure (float32: bit-exact; float16: compact)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.scales[0])
    cache = Path(a.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"kimi-linear-L{a.layers}-E{a.hidden}-X{a.experts}x{a.expert_ff}-mixed.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        write_gguf(path.with_suffix(".tmp"), a)
        path.with_suffix(".tmp").rename(path)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    size = path.stat().st_size
    print(f"GGUF {path.name}: {size / 2**30:.2f} GiB (experts Q4_K, matrices Q8_0, small tensors F32)")
    rows = {s: [] for s in a.scales}
    for r in range(a.runs):  # scale dtypes interleaved within each round
        for scales in a.scales:
            cmd = [sys.executable, __file__, "--child", str(path), "--scales", scales]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            rows[scales].append((res["seconds"], res["rss"], res["mlx_peak"]))
            print(f"run {r} scales {scales}: load {res['seconds']:.1f} s, peak RSS {res['rss'] / 2**30:.2f} GiB "
                  f"({res['rss'] / size:.2f}x file), MLX peak {res['mlx_peak'] / 2**30:.2f} GiB, "
                  f"logits finite: {res['finite']}")
    for scales, runs in rows.items():
        sec, rss, peak = (float(np.median(c)) for c in zip(*runs))
        print(f"median, scales {scales}: load {sec:.1f} s ({size / sec / 2**20:.0f} MiB/s), peak RSS "
              f"{rss / 2**30:.2f} GiB = {rss / size:.2f}x the file (target <= 1.3x), MLX peak {peak / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
