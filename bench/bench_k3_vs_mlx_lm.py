"""kimi-mlx vs mlx-lm (or mlx-vlm) on the same random Kimi-K3 checkpoint: prefill / decode tok/s and peak memory.

A small Kimi-K3 at the scale of the Kimi Linear bench model (hidden 768, 12 layers KDA:MLA 3:1 with MLA last, KDA
6 heads x 128 with the full-rank output gate and the lower-bound decay gate, MLA with q-LoRA and the sigmoid output
gate, 16 experts top-4 in a 384-wide latent MoE with its RMSNorm + 1 shared expert, first layer dense, SiTU
activations, AttnRes over blocks of 4 layers, vocab 8192), written ONCE in the official K3 layout
(``KimiK3ForConditionalGeneration``: ``language_model.model.layers.{i}...``, padded 1-D ``A_log``, bf16 matrices,
float32 A_log / dt_bias / convs / router bias / o_norm) into a cache dir and loaded by both implementations.
Same measurements, table and options as ``bench_vs_mlx_lm.py`` (whose timing, parity and BLAS code it uses); see
bench/README.md.

    python bench/bench_k3_vs_mlx_lm.py                      # float32, prefill 512/2048, decode after 512
    python bench/bench_k3_vs_mlx_lm.py --sizes 512 2048 8192 --profile
    python bench/bench_k3_vs_mlx_lm.py --anchor mlx-vlm --sizes 2048 --profile

``--anchor mlx-vlm`` compares with mlx-vlm 0.7.10's K3 text model instead (``mlx_vlm.models.kimi_k3.language``: the
same checkpoint through its ``sanitize``, float32; its MLA prefill is one SDPA call over the cache expanded per head).
mlx-vlm is a bench dependency only: ``pip install mlx-vlm==0.7.10``.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_mlx_lm import CONFIG as KIMI_LINEAR_CONFIG  # noqa: E402
from bench_vs_mlx_lm import (  # noqa: E402
    KEEP_F32,
    SEED,
    checkpoint_dir,
    load_mlx_lm,
    make_checkpoint,
    parse_args,
    profile_targets,
    run,
)

TEXT_CONFIG = {
    **KIMI_LINEAR_CONFIG,  # the Kimi Linear bench model's shapes, plus K3's features:
    "q_lora_rank": 384,
    "mla_use_output_gate": True,
    "routed_expert_hidden_size": 384,
    "latent_moe_use_norm": True,
    "routed_scaling_factor": 1.0,
    "topk_method": "noaux_tc",
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 4,
    "max_position_embeddings": 1048576,
    "linear_attn_config": {
        **KIMI_LINEAR_CONFIG["linear_attn_config"],
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
}
CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "text_config": TEXT_CONFIG,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}
A_LOG_PAD = 8  # the official checkpoint stores A_log 1-D, padded (8 entries for 2 heads); the first H are used


def make_k3_checkpoint(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The shared generator's tensors for the text config, re-laid out as the official K3 checkpoint."""
    out = {}
    for k, v in make_checkpoint(config["text_config"], seed).items():
        if k.endswith(".A_log"):
            v = v.reshape(-1)
            v = np.concatenate([v, np.zeros(-len(v) % A_LOG_PAD, np.float32)])
        out[f"language_model.{k}"] = v
    return out


class VlmTextModel:
    """mlx-vlm's K3 text model as the bench drives a model: ``model(tokens, cache=...)`` -> logits, ``make_cache()``."""

    def __init__(self, model):
        self.model = model

    def __call__(self, tokens, cache=None):
        return self.model(tokens, cache=cache).logits

    def make_cache(self):
        return self.model.make_cache()


def load_mlx_vlm(path: Path, dtype) -> VlmTextModel:
    """The checkpoint in mlx-vlm 0.7.10's ``kimi_k3`` text model (its ``sanitize`` maps the official layout), every
    weight in ``dtype`` for float32 (as ``load_mlx_lm``), as stored for bf16."""
    import mlx.core as mx
    from mlx_vlm.models.kimi_k3.config import TextConfig
    from mlx_vlm.models.kimi_k3.language import LanguageModel

    model = LanguageModel(TextConfig.from_dict(CONFIG["text_config"]))
    prefix = "language_model."  # sanitize maps the checkpoint's keys, then puts them back under this prefix
    weights = model.sanitize(mx.load(str(path / "model.safetensors")))
    model.load_weights([(k.removeprefix(prefix), v) for k, v in weights.items()], strict=True)
    if dtype == mx.float32:
        model.set_dtype(mx.float32)
    model.eval()
    mx.eval(model.parameters())
    return VlmTextModel(model)


def main(argv=None) -> int:
    args = parse_args(__doc__, argv, anchors=("mlx-lm", "mlx-vlm"))
    t = TEXT_CONFIG
    note = (f"; K3: q_lora {t['q_lora_rank']}, latent MoE {t['routed_expert_hidden_size']} (+norm), SiTU "
            f"{t['activation_situ_beta']}/{t['activation_situ_linear_beta']}, AttnRes block {t['attn_res_block_size']}"
            f", KDA gate lower bound {t['linear_attn_config']['gate_lower_bound']}, full-rank KDA gate, MLA output gate")
    make_path = lambda: checkpoint_dir(  # noqa: E731
        args.cache_dir, CONFIG, make_k3_checkpoint, "kimi_k3_bench", SEED, KEEP_F32 + ("o_norm.weight",)
    )
    return run(args, make_path, TEXT_CONFIG, partial(profile_targets, k3=True), note,
               {"mlx-lm": load_mlx_lm, "mlx-vlm": load_mlx_vlm})


if __name__ == "__main__":
    sys.exit(main())
