"""Expert-parallel decode: only the local (token, slot) pairs (now) vs every slot with other ranks' slots on local
expert 0, weighted 0 (before), at Kimi-Linear-48B's widths.

The model is the real-width slice of Kimi-Linear-48B (3 layers: KDA, KDA, MLA; hidden 2304, 32 heads x 128,
kv_lora 512; layer 0 dense 9216, layers 1-2 MoE: ``--experts`` (64) experts x 1024, top-8, + 1 shared; vocab 8192;
float32, experts optionally ``--bits`` 4 / 8, MLX affine, group 64), random weights from one seed (every rank builds
the same model). Routing is what the random router picks, so about 1 / n of a token's 8 slots are local on n ranks.

Two settings:
- default: one process holding rank 0's share of n = ``--simulate`` (1 2 4 8) ranks (``shard_model`` on the
  single-process group, whose all_sum is the identity): one rank's compute without communication. n = 1 holds
  every expert, so both ways compute the same rows: what differs is the new way's cost (host read, compaction);
- ``--ranks N``: N ring ranks on localhost under ``mlx.launch``, rank r pinned to core r (tensor + expert parallel).

Measured per round, the two ways alternating (the old one re-created in this file by routing fewer than
``SORTED_MIN_PAIRS`` pairs to ``ExpertParallelMoE._masked``, the path kept for ``mx.compile``):
- ``moe layer``: one MoE block (layer 1) on one decode token (``[1, 1, 2304]``), evaluated per call;
- ``decode step``: mlx-lm's ``generate_step`` (pipelined: the next step is queued before the token is read) after a
  16-token prompt, greedy; seconds per step. The new way reads two counts on the host per MoE block (a sync that
  also stops the next step's graph from being built while this one computes), so this row is where that cost shows.
Medians over ``--runs`` rounds (after one warm-up round); ratio = median of the per-round ratios old / new. The
greedy tokens of both ways are compared.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/bench_expert_parallel.py
    LD_PRELOAD=... python bench/bench_expert_parallel.py --ranks 2
    LD_PRELOAD=... python bench/bench_expert_parallel.py --bits 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent


def slice_config(experts: int) -> dict:
    """Kimi-Linear-48B-A3B's config.json cut to 3 layers (KDA, KDA, MLA), ``experts`` experts and vocab 8192."""
    return {
        "model_type": "kimi_linear", "vocab_size": 8192, "hidden_size": 2304, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 72, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": True,
        "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4, "kda_layers": [1, 2],
                               "full_attn_layers": [3]},
        "num_experts": experts, "num_experts_per_token": 8, "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "rope_scaling": None, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
    }


@contextmanager
def old_decode_path():
    """``ExpertParallelMoE`` as it was: fewer than ``SORTED_MIN_PAIRS`` pairs run every slot (``_masked``)."""
    from kimi_mlx.layers.moe import SORTED_MIN_PAIRS
    from kimi_mlx.parallel.shard import ExpertParallelMoE

    compacted = ExpertParallelMoE._compacted

    def dispatch(self, z, inds, local):
        return (self._masked if inds.size < SORTED_MIN_PAIRS else compacted.__get__(self))(z, inds, local)

    ExpertParallelMoE._compacted = dispatch
    try:
        yield
    finally:
        ExpertParallelMoE._compacted = compacted


def build(args, simulate: int):
    """The slice model holding this rank's share (``simulate`` > 1 in one process: rank 0's share of that many)."""
    import mlx.core as mx
    import mlx.nn as nn

    from kimi_mlx.config import KimiConfig
    from kimi_mlx.models.kimi_linear import Model
    from kimi_mlx.parallel.shard import shard_model, tensor_parallel
    from kimi_mlx.parallel.splits import tensor_shares

    group = mx.distributed.init()
    mx.random.seed(0)
    cfg = KimiConfig.from_hf(slice_config(args.experts))
    model = Model(cfg)
    if group.size() > 1:
        tensor_parallel(model, group)
    else:
        shard_model(model, tensor_shares(cfg, simulate)[0], group)
    if args.bits:
        nn.quantize(model, group_size=64, bits=args.bits,
                    class_predicate=lambda p, m: ".switch_mlp." in p and hasattr(m, "to_quantized"))
    model.eval()
    mx.eval(model.parameters())
    return model, cfg


def measure(model, cfg, args) -> dict:
    """Per round, old then new (then new then old): MoE layer seconds per token, decode seconds per step, tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    moe = model.layers[1].mlp
    xs = [mx.random.normal((1, 1, cfg.hidden_size), key=mx.random.key(i)) for i in range(8)]  # decode tokens
    prompt = mx.random.randint(0, cfg.vocab_size, (args.prompt,), key=mx.random.key(99))

    def layer() -> float:
        tic = time.perf_counter()
        for x in xs:
            mx.eval(moe(x))
        return (time.perf_counter() - tic) / len(xs)

    def step() -> tuple[float, list[int]]:
        steps = generate_step(prompt, model, max_tokens=args.decode + 1)
        tokens = [next(steps)[0]]  # prefill and the first token
        tic = time.perf_counter()
        tokens += [t for t, _ in steps]
        return (time.perf_counter() - tic) / args.decode, tokens

    out = {"layer": {"old": [], "new": []}, "step": {"old": [], "new": []}, "tokens": {}}
    for i in range(args.runs + 1):  # round 0 warms up
        for way in (("old", "new") if i % 2 else ("new", "old")):
            with old_decode_path() if way == "old" else _nothing():
                t_layer = layer()
                t_step, tokens = step()
            if i:
                out["layer"][way].append(t_layer)
                out["step"][way].append(t_step)
            out["tokens"][way] = tokens
    return out


@contextmanager
def _nothing():
    yield


def worker(args) -> None:
    import mlx.core as mx

    model, cfg = build(args, args.simulate_one)
    out = measure(model, cfg, args)
    group = mx.distributed.init()
    out["rank"], out["ranks"] = group.rank(), group.size()
    Path(args.out, f"{args.simulate_one}-rank{group.rank()}.json").write_text(json.dumps(out))


def run(args, n_ranks: int, simulate: int, out: Path) -> list[dict]:
    """The worker on ``n_ranks`` pinned ranks (1: one process on core 0 holding rank 0's share of ``simulate``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--simulate-one", str(simulate),
           "--experts", str(args.experts), "--bits", str(args.bits), "--runs", str(args.runs),
           "--prompt", str(args.prompt), "--decode", str(args.decode), "--out", str(out)]
    from bench_distributed import pinned_launch

    proc = subprocess.run(pinned_launch(cmd, n_ranks, out), capture_output=True, text=True, timeout=3600)
    files = [out / f"{simulate}-rank{r}.json" for r in range(n_ranks)]
    if not all(f.exists() for f in files):  # mlx.launch exits 0 even when a rank fails
        sys.exit(f"{n_ranks} rank(s), share of {simulate}: failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(f.read_text()) for f in files]


def row(label: str, r: dict) -> str:
    def cell(kind: str, scale: float) -> str:
        old, new = (statistics.median(r[kind][w]) * scale for w in ("old", "new"))
        ratios = [o / n for o, n in zip(r[kind]["old"], r[kind]["new"])]
        return f"{old:.1f} | {new:.1f} | {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    same = "yes" if r["tokens"]["old"] == r["tokens"]["new"] else "NO"
    return f"| {label} | {cell('layer', 1e3)} | {cell('step', 1e3)} | {same} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simulate", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="in one process: rank 0's share of this many ranks (1: every slot local, both ways compute "
                         "the same rows and the new one's host read and compaction are all that differ)")
    ap.add_argument("--ranks", type=int, default=0, help="run on this many ring ranks instead (mlx.launch, pinned)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer (Kimi-Linear-48B: 256)")
    ap.add_argument("--bits", type=int, default=0, choices=[0, 4, 8], help="quantize the routed experts (0: float32)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=8, help="timed decode steps per round")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--simulate-one", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0

    sys.path.insert(0, str(HERE))
    from bench_vs_mlx_lm import blas_in_use

    print(f"BLAS: {blas_in_use()}")
    experts = f"{args.bits}-bit experts" if args.bits else "float32 experts"
    print(f"Kimi-Linear-48B real-width slice, {args.experts} experts top-8, {experts}; medians of {args.runs} rounds, "
          f"old / new alternating; decode: generate_step after a {args.prompt}-token prompt, {args.decode} steps")
    print()
    print("| rank | MoE layer ms/token: old | new | old / new | decode ms/step: old | new | old / new | "
          "same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        if args.ranks > 1:
            for r in run(args, args.ranks, args.ranks, Path(tmp)):
                print(row(f"rank {r['rank']} of {args.ranks} (ring)", r), flush=True)
        else:
            for n in args.simulate:
                print(row(f"rank 0 of {n} (one process)", run(args, 1, n, Path(tmp))[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
