"""LoRA / DoRA fine-tuning (kimi_mlx.tuner, ``kimi-mlx lora`` / ``fuse``): overfitting tiny Kimi Linear and K3 models
with gradients only in the adapters, the chunked KDA path under training (also on a quantized base), adapter round
trips, fusing, mlx-lm interoperability both ways, and clear errors on bad data and foreign adapters."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import TrainingArgs, default_loss

from kimi_mlx.loading import load, load_model
from kimi_mlx.tuner.adapters import (
    ADAPTER_TYPES,
    PROJECTION_GROUPS,
    AdapterError,
    adapter_config,
    apply_adapters,
    load_adapters,
    save_adapters,
    select_modules,
)
from kimi_mlx.tuner.trainer import train

PERIOD = [7, 300, 41, 99, 150, 3, 18, 260]  # a repeating token pattern: learnable in a few steps


def fresh(path, **kw):
    """A new float32 model from a fixture dir (tests that wrap modules must not touch the session models)."""
    model, cfg = load_model(path, dtype=mx.float32, **kw)
    return model, cfg


def pattern_data(n: int = 2, length: int = 48) -> list[tuple[list[int], int]]:
    """``n`` rotations of a periodic sequence, as (tokens, prompt length 0) items."""
    return [((PERIOD[i:] + PERIOD[:i]) * (length // len(PERIOD)), 0) for i in range(n)]


def as_batch(data):
    return mx.array([d for d, _ in data]), mx.array([[0, len(d)] for d, _ in data])


def randomize_adapters(model, seed: int = 0, std: float = 0.02) -> None:
    """Give every adapter tensor random values (lora_b starts at zero, which would make every check trivial)."""
    params = tree_flatten(model.trainable_parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = [(k, v + std * mx.random.normal(v.shape, key=key)) for (k, v), key in zip(params, keys)]
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())


def frozen_params(model) -> dict[str, mx.array]:
    trainable = dict(tree_flatten(model.trainable_parameters()))
    return {k: mx.array(v) for k, v in tree_flatten(model.parameters()) if k not in trainable}


def run_training(model, data, tmp_path, iters: int, lr: float) -> list[dict]:
    args = TrainingArgs(
        batch_size=len(data),
        iters=iters,
        steps_per_report=5,
        steps_per_eval=10**6,
        steps_per_save=10**6,
        max_seq_length=512,
        adapter_file=str(tmp_path / "adapters.safetensors"),
    )
    return train(model, optim.Adam(learning_rate=lr), data, None, args, tmp_path, progress=False, log=lambda s: None)


# ------------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_overfit_with_every_projection_only_adapters_change(name, kl_dir, k3_dir, tmp_path, monkeypatch):
    """LoRA on every projection group (K3: including the AttnRes projections, router and per-expert LoRA on the
    stacked routed experts): every adapter gets a gradient at the start, and the model overfits a 2-sequence dataset:
    loss from ~ln(vocab) to below 0.35 * ln(vocab) within 80 Adam steps (lr 1e-3, rank 8, scale 10; at lr 3e-3 the
    run was on the edge of stability: its final loss ranged 0.4-3.3 with float32 rounding alone, e.g. the BLAS or
    the chunk size, where this one ends at 0.1-1.5). Base weights stay bit-for-bit equal and the KDA scan runs
    chunked (the token-by-token path is never called with more than one token)."""
    import kimi_mlx.ops.kda as kda_ops

    model, cfg = fresh((kl_dir if name == "kimi_linear" else k3_dir) / "hf")
    paths = select_modules(model, PROJECTION_GROUPS)
    groups_seen = {g for g, rels in PROJECTION_GROUPS.items() for p in paths for r in rels if p.endswith(r)}
    assert groups_seen >= {"kda", "kda_gates", "mla", "mlp", "shared_experts", "experts", "router"}
    if name == "kimi_k3":
        assert "attn_res" in groups_seen
    mx.random.seed(0)
    apply_adapters(model, list(paths), rank=8, scale=10.0)
    before = frozen_params(model)
    data = pattern_data()
    grads = mx.grad(lambda p: (model.update(p), default_loss(model, *as_batch(data))[0])[1])(
        model.trainable_parameters()
    )
    flat = dict(tree_flatten(grads))
    assert flat and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in flat)
    # (K3's first AttnRes mix point has a single source, so its projection is never called)
    unused = "language_model.model.layers.0.self_attention_res.proj.lora_b"
    zero = [k for k, v in flat.items() if k.endswith("lora_b") and mx.abs(v).max().item() == 0 and k != unused]
    assert not zero, f"adapters without gradient: {zero[:5]}"

    calls = []
    real = kda_ops.kda_recurrent
    monkeypatch.setattr(kda_ops, "kda_recurrent", lambda q, *a, **k: calls.append(q.shape[1]) or real(q, *a, **k))
    loss0 = default_loss(model, *as_batch(data))[0].item()
    assert abs(loss0 - math.log(cfg.vocab_size)) < 1.0
    iters = 80
    records = run_training(model, data, tmp_path, iters=iters, lr=1e-3)
    loss = default_loss(model, *as_batch(data))[0].item()
    assert loss < 0.35 * math.log(cfg.vocab_size), (loss0, loss, records)
    assert all(t <= 1 for t in calls), f"token-by-token KDA ran on {calls} tokens during training"

    after = frozen_params(model)
    assert before.keys() == after.keys()
    changed = [k for k in before if not mx.array_equal(before[k], after[k]).item()]
    assert not changed, f"base weights changed: {changed[:5]}"
    assert (tmp_path / "metrics.jsonl").read_text().count("train_loss") == iters // 5  # steps_per_report 5
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_qlora_on_quantized_base(mode, kl_dir, tmp_path):
    """QLoRA: the base quantized on load (affine 4-bit group 64, or mxfp4 group 32), adapters float32; training
    lowers the loss and leaves the quantized weights, scales and biases bit-for-bit unchanged."""
    spec = {"bits": 4, "group_size": 64} if mode == "affine" else {"bits": 4, "group_size": 32, "mode": "mxfp4"}
    model, cfg = fresh(kl_dir / "hf", quantize=spec)
    quantized = [p for p, m in model.named_modules() if hasattr(m, "scales")]
    assert any("switch_mlp" in p for p in quantized) and any("self_attn" in p for p in quantized)
    apply_adapters(model, list(select_modules(model, ["kda", "mla", "experts"])), rank=8, scale=20.0)
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.trainable_parameters()))
    before = frozen_params(model)
    data = pattern_data()
    loss0 = default_loss(model, *as_batch(data))[0].item()
    run_training(model, data, tmp_path, iters=6, lr=5e-3)
    assert default_loss(model, *as_batch(data))[0].item() < loss0 - 1.0
    after = frozen_params(model)
    assert all(mx.array_equal(before[k], after[k]).item() for k in before)


def test_sorted_expert_lora_matches_gather_path(kl_dir):
    """Per-expert LoRA (LoRASwitchLinear) through our sorted dense-per-expert path equals mlx-lm's gather_mm
    path, in value and in the adapter gradients."""
    from kimi_mlx.layers.moe import sorted_switch_glu

    model, _ = fresh(kl_dir / "hf")
    apply_adapters(model, list(select_modules(model, ["experts"], num_layers=1)), rank=4, scale=3.0)
    randomize_adapters(model, std=0.1)
    switch = model.layers[-1].mlp.switch_mlp
    x = mx.random.normal((2, 40, switch.gate_proj.linear.input_dims), key=mx.random.key(3))
    inds = mx.random.randint(0, switch.gate_proj.num_experts, (2, 40, 2), key=mx.random.key(4)).astype(mx.uint32)

    def loss(params, fn):
        switch.update(params)
        return (fn(x) ** 2).sum()

    va, ga = mx.value_and_grad(loss)(switch.trainable_parameters(), lambda z: sorted_switch_glu(switch, z, inds))
    vb, gb = mx.value_and_grad(loss)(switch.trainable_parameters(), lambda z: switch(z, inds))
    assert abs(va.item() - vb.item()) <= 1e-5 * abs(vb.item())
    for (k, a), (_, b) in zip(tree_flatten(ga), tree_flatten(gb)):
        assert mx.abs(a - b).max().item() <= 1e-4 * mx.abs(b).max().item() + 1e-7, k


def test_dora_trains_and_rejects_experts(kl_dir, tmp_path):
    """DoRA on the attention projections trains (loss falls); asking for DoRA on the stacked experts is an error
    naming the module (there is no per-expert DoRA)."""
    model, _ = fresh(kl_dir / "hf")
    with pytest.raises(ValueError, match=r"switch_mlp.*DoRA"):
        apply_adapters(model, list(select_modules(model, ["experts"])), fine_tune_type="dora")
    model, _ = fresh(kl_dir / "hf")
    apply_adapters(model, list(select_modules(model, ["kda", "mla"])), fine_tune_type="dora", rank=8, scale=20.0)
    assert any(k.endswith(".m") for k, _ in tree_flatten(model.trainable_parameters()))
    data = pattern_data()
    loss0 = default_loss(model, *as_batch(data))[0].item()
    run_training(model, data, tmp_path, iters=5, lr=5e-3)
    assert default_loss(model, *as_batch(data))[0].item() < loss0 - 0.5


# ------------------------------------------------------------------------------------- adapter files, fuse


def make_adapter_dir(model_dir, out, groups=("kda", "mla", "mlp", "experts", "shared_experts"), seed=0, **kw):
    """Wrap a fresh model, randomize its adapters, save them with config; returns the model (float32)."""
    model, _ = fresh(model_dir, **kw)
    paths = list(select_modules(model, groups))
    apply_adapters(model, paths, rank=4, scale=5.0)
    randomize_adapters(model, seed)
    model.eval()
    save_adapters(model, out, adapter_config(model, paths, "lora", 4, 5.0, 0.0, -1, groups))
    return model


TOKENS = mx.array([[384, 12, 200, 45, 77, 301, 5, 9, 144, 260, 33, 71, 18, 402, 250, 6, 90, 91, 92, 17] * 2])


def test_adapter_round_trip_and_fuse_float(kl_dir, tmp_path):
    """save -> load into a fresh model -> identical logits (bit-for-bit); fuse -> an MLX dir that kimi_mlx.load
    reads, whose logits equal base + adapter within 1e-5 (float32); the adapters change the logits."""
    from kimi_mlx.cli.fuse import fuse_model

    model = make_adapter_dir(kl_dir / "hf", tmp_path / "ad")
    ref = model(TOKENS)
    loaded, _ = load(kl_dir / "hf", dtype=mx.float32, adapter_path=tmp_path / "ad")
    assert mx.array_equal(loaded(TOKENS), ref).item()
    base, _ = fresh(kl_dir / "hf")
    assert mx.abs(base(TOKENS) - ref).max().item() > 1e-2

    fuse_model(str(kl_dir / "hf"), str(tmp_path / "ad"), str(tmp_path / "fused"), dtype=mx.float32)
    fused, _ = load(tmp_path / "fused", dtype=mx.float32)
    assert not any("lora" in k for k, _ in tree_flatten(fused.parameters()))
    assert mx.abs(fused(TOKENS) - ref).max().item() <= 1e-5


def test_fuse_quantized_base(kl_dir, tmp_path):
    """Affine-quantized base (4-bit, group 64): --dequantize gives float weights equal to dequantized base +
    adapter (logits within 1e-5); the default re-quantizes each merged projection to the base's layout (config.json
    and the loaded modules say 4 bits, group 64): its tensors are exactly ``mx.quantize`` of the dequantized merge,
    and projections without an adapter keep the base's quantized tensors bit for bit."""
    from kimi_mlx.cli.convert import convert
    from kimi_mlx.cli.fuse import fuse_model

    qdir = tmp_path / "q4"
    convert(_convert_args(kl_dir / "hf", qdir))
    model = make_adapter_dir(qdir, tmp_path / "ad", groups=("kda", "mla"))
    ref = model(TOKENS)

    fuse_model(str(qdir), str(tmp_path / "ad"), str(tmp_path / "deq"), dequantize=True, dtype=mx.float32)
    deq, _ = load(tmp_path / "deq", dtype=mx.float32)
    assert not any(hasattr(m, "scales") for _, m in deq.named_modules())
    assert mx.abs(deq(TOKENS) - ref).max().item() <= 1e-5

    fuse_model(str(qdir), str(tmp_path / "ad"), str(tmp_path / "req"), dtype=mx.float32)
    assert json.loads((tmp_path / "req" / "config.json").read_text())["quantization"]["bits"] == 4
    req, _ = load(tmp_path / "req", dtype=mx.float32)
    base, _ = load(qdir, dtype=mx.float32)
    req_m, deq_m, base_m = (dict(m.named_modules()) for m in (req, deq, base))
    merged = "model.layers.0.self_attn.q_proj"
    untouched = "model.layers.1.mlp.switch_mlp.up_proj"
    assert (req_m[merged].bits, req_m[merged].group_size) == (4, 64)
    w, scales, biases = mx.quantize(deq_m[merged].weight, 64, 4)
    for name, value in (("weight", w), ("scales", scales), ("biases", biases)):
        assert mx.array_equal(req_m[merged][name], value).item(), name
        assert mx.array_equal(req_m[untouched][name], base_m[untouched][name]).item(), name


def _convert_args(src, out):
    from types import SimpleNamespace

    return SimpleNamespace(
        model=str(src),
        out=str(out),
        quantize=4,
        q_group_size=64,
        dtype="float32",
        requantize=False,
        gguf_scales="float32",
        force=False,
        max_shard_gb=5.0,
        quiet=True,
    )


def test_foreign_adapter_is_refused(kl_dir, k3_dir, tmp_path):
    """A K3 adapter loaded into Kimi Linear (refused by its config's model_type, and without one by its tensor
    names), or one with another rank's shapes, is an AdapterError naming the file and the tensor; the model is left
    without adapters."""
    make_adapter_dir(k3_dir / "hf", tmp_path / "k3", groups=("kda", "attn_res"))
    model, _ = fresh(kl_dir / "hf")
    with pytest.raises(AdapterError, match=r"adapter_config\.json: adapter trained for a kimi_k3 model, not kimi_lin"):
        load_adapters(model, tmp_path / "k3")
    cfg = json.loads((tmp_path / "k3" / "adapter_config.json").read_text())
    del cfg["model_type"]  # as in an mlx-lm adapter config: the tensors themselves must not fit
    (tmp_path / "k3" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"adapters\.safetensors.*language_model\.model\.layers"):
        load_adapters(model, tmp_path / "k3")
    assert not any(isinstance(m, ADAPTER_TYPES) for _, m in model.named_modules())

    make_adapter_dir(kl_dir / "hf", tmp_path / "kl", groups=("kda",))
    cfg = json.loads((tmp_path / "kl" / "adapter_config.json").read_text())
    cfg["lora_parameters"]["rank"] = 16
    (tmp_path / "kl" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"lora_a: shape \(256, 4\), expected \(256, 16\)"):
        load_adapters(fresh(kl_dir / "hf")[0], tmp_path / "kl")
    with pytest.raises(AdapterError, match="adapter_config.json: missing"):
        load_adapters(fresh(kl_dir / "hf")[0], tmp_path)


# ---------------------------------------------------------------------------------------------- mlx-lm interop


def _mlx_lm_float32(path):
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model as mlx_lm_load_model

    ref, _ = mlx_lm_load_model(path)
    ref.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, ref.parameters()))
    return ref


def test_mlx_lm_adapters_load_into_kimi_mlx(kl_dir, tmp_path):
    """Adapters made with mlx-lm's tuner (linear_to_lora_layers on its kimi_linear, every linear of every layer,
    saved as mlx_lm.lora does) load into ours; the change they make to the logits agrees with mlx-lm's within 1e-5
    of the largest logit, and the adapted logits agree within 1e-4 (the two float32 bases alone differ by ~2e-5)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    ref = _mlx_lm_float32(kl_dir / "hf")
    base_ref = ref(TOKENS)
    ref.freeze()
    linear_to_lora_layers(ref, 4, {"rank": 4, "scale": 5.0, "dropout": 0.0})
    randomize_adapters(ref, seed=1)
    out = tmp_path / "mlx_lm_adapters"
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(ref.trainable_parameters())))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {"fine_tune_type": "lora", "num_layers": 4, "lora_parameters": {"rank": 4, "scale": 5.0, "dropout": 0.0}}
        )
    )
    adapted_ref = ref(TOKENS)

    ours, _ = fresh(kl_dir / "hf")
    base_ours = ours(TOKENS)
    load_adapters(ours, out)
    adapted = ours(TOKENS)
    delta_ref, delta = adapted_ref - base_ref, adapted - base_ours
    assert mx.abs(delta_ref).max().item() > 1e-2
    scale = mx.abs(adapted_ref).max().item()
    assert mx.abs(delta - delta_ref).max().item() <= 1e-5 * scale
    assert mx.abs(adapted - adapted_ref).max().item() <= 1e-4


def test_kimi_mlx_adapters_load_into_mlx_lm(kl_dir, tmp_path):
    """Adapters saved by kimi-mlx (every group incl. per-expert LoRA and the router) load with mlx-lm's
    ``load_adapters``; same agreement as the other direction."""
    from mlx_lm.tuner.utils import load_adapters as mlx_lm_load_adapters

    ours = make_adapter_dir(kl_dir / "hf", tmp_path / "ad", groups=tuple(PROJECTION_GROUPS))
    base_ours = fresh(kl_dir / "hf")[0](TOKENS)
    adapted = ours(TOKENS)
    ref = _mlx_lm_float32(kl_dir / "hf")
    base_ref = ref(TOKENS)
    mlx_lm_load_adapters(ref, str(tmp_path / "ad"))
    ref.eval()
    adapted_ref = ref(TOKENS)
    scale = mx.abs(adapted_ref).max().item()
    assert mx.abs((adapted - base_ours) - (adapted_ref - base_ref)).max().item() <= 1e-5 * scale
    assert mx.abs(adapted - adapted_ref).max().item() <= 1e-4


# ------------------------------------------------------------------------------------------------- data


def test_data_forms_and_prompt_mask(tmp_path):
    """text / prompt-completion / messages records; with --mask-prompt the prompt length is exactly the rendered
    prompt + generation prompt, so the loss covers the assistant's answer (and its end marker) only."""
    from kimi_mlx.chat.format import render_chat
    from kimi_mlx.tuner.datasets import load_datasets

    _, tok = load("demo")
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."}]
    (tmp_path / "train.jsonl").write_text(json.dumps({"messages": msgs}) + "\n\n")
    (tmp_path / "valid.jsonl").write_text(json.dumps({"prompt": msgs[0]["content"], "completion": "5"}) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"text": "plain text"}) + "\n")
    sets = load_datasets(tmp_path, tok)
    assert [len(sets[s]) for s in ("train", "valid", "test")] == [1, 1, 1]
    ids, offset = sets["train"].tokenized()[0]
    assert ids == render_chat(tok, msgs, add_generation_prompt=False) and offset == 0
    text_ids, _ = sets["test"].tokenized()[0]
    assert text_ids == tok.encode("plain text") + [tok.eos_token_id]

    (tmp_path / "test.jsonl").unlink()
    masked = load_datasets(tmp_path, tok, mask_prompt=True)
    ids, offset = masked["train"].tokenized()[0]
    prompt = render_chat(tok, msgs[:1], add_generation_prompt=True)
    assert offset == len(prompt) and ids[:offset] == prompt
    assert tok.decode(ids[offset:]).startswith("2 plus 3 is 5.")


def test_bad_data_errors(tmp_path):
    """A malformed line names file:line; an empty split and a record of another form are errors; a single file
    splits by ratio."""
    from kimi_mlx.tuner.datasets import DataError, load_datasets

    _, tok = load("demo")
    good = json.dumps({"text": "hello"})
    (tmp_path / "train.jsonl").write_text(f"{good}\n{good}\n{{'text': broken\n")
    with pytest.raises(DataError, match=r"train\.jsonl:3: not valid JSON"):
        load_datasets(tmp_path, tok)
    (tmp_path / "train.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"train\.jsonl: no records \(empty split\)"):
        load_datasets(tmp_path, tok)
    (tmp_path / "train.jsonl").write_text(f"{good}\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    with pytest.raises(DataError, match=r"train\.jsonl:2: record is not in the file's 'text' form"):
        load_datasets(tmp_path, tok)
    one = tmp_path / "all.jsonl"
    one.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(20)))
    sets = load_datasets(one, tok, split="0.8,0.1,0.1")
    assert [len(sets[s]) for s in ("train", "valid", "test")] == [16, 2, 2]
    with pytest.raises(ValueError, match="summing to 1"):
        load_datasets(one, tok, split="0.8,0.3,0")


def test_long_sequence_truncated_with_warning(kl_dir, tmp_path, capsys):
    """Our training loop cuts a sequence longer than ``max_seq_length`` to it, with a warning: one step on a
    100-token record with max_seq_length=64 trains on 63 target tokens (100 when nothing is cut)."""
    model, _ = fresh(kl_dir / "hf")
    apply_adapters(model, list(select_modules(model, ["kda"], num_layers=1)), rank=4, scale=1.0)
    args = TrainingArgs(batch_size=1, iters=1, steps_per_report=1, steps_per_eval=10**6, steps_per_save=10**6,
                        max_seq_length=64, adapter_file=str(tmp_path / "adapters.safetensors"))
    records = train(model, optim.SGD(learning_rate=0.0), [(list(range(1, 101)), 0)], None, args, tmp_path,
                    progress=False, log=lambda s: None)
    assert records[0]["trained_tokens"] == 63
    assert "truncated to 64" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------- CLI


def test_cli_lora_fuse_generate_demo(tmp_path):
    """``kimi-mlx lora`` on the built-in demo model and the shipped demo data (8 iterations, masked prompt), then
    ``--resume-adapter-file`` + ``--test``, then ``kimi-mlx fuse``: mlx-lm-style lines, adapter files, metrics,
    loss curve; the fused model loads."""
    from kimi_mlx.data import DEMO_DATA, demo_records

    for split, records in demo_records().items():
        assert (DEMO_DATA / f"{split}.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in records)
    cmd = [
        sys.executable,
        "-m",
        "kimi_mlx.cli.main",
        "lora",
        "--model",
        "demo",
        "--train",
        "--data",
        "demo",
        "--mask-prompt",
        "--iters",
        "8",
        "--batch-size",
        "4",
        "--learning-rate",
        "2e-3",
        "--steps-per-report",
        "4",
        "--steps-per-eval",
        "8",
        "--val-batches",
        "2",
        "--max-seq-length",
        "48",
        "--adapter-path",
        "ad",
        "--quiet",
    ]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Iter 4: Train loss" in run.stdout and "Iter 8: Val loss" in run.stdout
    assert "truncated to 48" in run.stdout  # the demo records have 55 tokens
    files = {p.name for p in (tmp_path / "ad").iterdir()}
    assert {"adapters.safetensors", "adapter_config.json", "metrics.jsonl", "loss_curve.png"} <= files
    records = [json.loads(x) for x in (tmp_path / "ad" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "train_loss" in r] == [4, 8]

    resume = cmd[:-5] + [
        "--iters",
        "2",
        "--adapter-path",
        "ad2",
        "--resume-adapter-file",
        "ad/adapters.safetensors",
        "--test",
        "--test-batches",
        "2",
        "--quiet",
    ]
    run = subprocess.run(resume, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Loaded adapter weights from ad/adapters.safetensors" in run.stdout and "Test loss" in run.stdout

    fuse = [
        sys.executable,
        "-m",
        "kimi_mlx.cli.main",
        "fuse",
        "--model",
        "demo",
        "--adapter-path",
        "ad",
        "--save-path",
        "fused",
    ]
    run = subprocess.run(fuse, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    model, _ = load(tmp_path / "fused")
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 512)


def test_cli_errors(tmp_path):
    """Bad --data line, a foreign adapter and nothing-to-do all exit 2 with the reason on stderr."""
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\nnot json\n')
    base = [sys.executable, "-m", "kimi_mlx.cli.main", "lora", "--model", "demo", "--data", str(tmp_path)]
    run = subprocess.run(base + ["--train"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "train.jsonl:2: not valid JSON" in run.stderr
    run = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "pass --train and/or --test" in run.stderr


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_gradient_checkpointing_same_gradients(name, kl_dir, k3_dir):
    """With gradient checkpointing (every mixer and FFN recomputed in the backward pass) the loss and the adapter
    gradients equal the plain ones (to float32 rounding), and the patch is undone afterwards."""
    from kimi_mlx.layers.moe import SparseMoE
    from kimi_mlx.tuner.trainer import gradient_checkpointing

    model, _ = fresh((kl_dir if name == "kimi_linear" else k3_dir) / "hf")
    mx.random.seed(0)
    apply_adapters(model, list(select_modules(model, PROJECTION_GROUPS)), rank=4, scale=5.0)
    randomize_adapters(model)
    batch = as_batch(pattern_data())

    def grads():
        fn = mx.value_and_grad(lambda p: (model.update(p), default_loss(model, *batch)[0])[1])
        val, g = fn(model.trainable_parameters())
        mx.eval(val, g)
        return val.item(), dict(tree_flatten(g))

    plain_call = SparseMoE.__call__
    v0, g0 = grads()
    with gradient_checkpointing(True):
        assert SparseMoE.__call__ is not plain_call
        v1, g1 = grads()
    assert SparseMoE.__call__ is plain_call
    assert abs(v0 - v1) <= 1e-6 * abs(v0)
    for k in g0:
        assert mx.abs(g0[k] - g1[k]).max().item() <= 1e-5 * (mx.abs(g0[k]).max().item() + 1e-6), k


def test_grad_accumulation_equals_larger_batch(kl_dir, tmp_path):
    """Two accumulated batches of one sequence then one SGD update = one update on the batch of both sequences
    (equal lengths, so the per-batch mean losses average to the joint mean): same adapter weights to 1e-6."""
    data = pattern_data()
    results = []
    for batch_size, accum in ((2, 1), (1, 2)):
        model, _ = fresh(kl_dir / "hf")
        mx.random.seed(0)
        apply_adapters(model, list(select_modules(model, ["kda", "mla"])), rank=4, scale=5.0)
        randomize_adapters(model)
        args = TrainingArgs(
            batch_size=batch_size,
            iters=accum,
            steps_per_report=10,
            steps_per_eval=10**6,
            steps_per_save=10**6,
            grad_accumulation_steps=accum,
            adapter_file=str(tmp_path / f"a{accum}.safetensors"),
        )
        train(model, optim.SGD(learning_rate=0.5), data, None, args, tmp_path, progress=False, log=lambda s: None)
        results.append(dict(tree_flatten(model.trainable_parameters())))
    a, b = results
    assert a.keys() == b.keys()
    assert max(mx.abs(a[k] - b[k]).max().item() for k in a) <= 1e-6


def test_learning_rate_schedules():
    """--lr-schedule decays over --iters after --warmup (mlx-lm's build_schedule): warm-up from 0 to the rate,
    cosine to ~0 at the end; --warmup without a schedule is an error."""
    from types import SimpleNamespace

    from kimi_mlx.cli.lora import learning_rate

    sched = learning_rate(SimpleNamespace(learning_rate=1e-3, lr_schedule="cosine_decay", warmup=10, iters=110))
    assert sched(mx.array(0)).item() == 0.0
    assert abs(sched(mx.array(10)).item() - 1e-3) < 1e-9
    assert sched(mx.array(110)).item() < 1e-3 * 1e-3
    assert learning_rate(SimpleNamespace(learning_rate=1e-3, lr_schedule=None, warmup=0, iters=5)) == 1e-3
    with pytest.raises(ValueError, match="--warmup needs --lr-schedule"):
        learning_rate(SimpleNamespace(learning_rate=1e-3, lr_schedule=None, warmup=3, iters=5))


@pytest.mark.parametrize("make_opt", [
    lambda: optim.Adam(learning_rate=optim.cosine_decay(1e-2, 10)),
    lambda: optim.AdamW(learning_rate=1e-2, weight_decay=0.1),
    lambda: optim.SGD(learning_rate=0.5, momentum=0.9),
], ids=["adam-schedule", "adamw", "sgd-momentum"])
def test_compiled_update_equals_optimizer_update(make_opt):
    """The step's compiled update gives the adapters and optimizer state ``optimizer.update`` gives, step after
    step (a schedule, decoupled weight decay, momentum), and leaves the frozen weights alone."""
    import mlx.nn as nn
    from mlx.utils import tree_map
    from mlx_lm.tuner.lora import LoRALinear

    from kimi_mlx.tuner.trainer import compiled_update

    def model():
        mx.random.seed(3)
        m = nn.Sequential(LoRALinear.from_base(nn.Linear(16, 12), r=4), LoRALinear.from_base(nn.Linear(12, 8), r=4))
        m.freeze()
        for layer in m.layers:
            layer.unfreeze(keys=["lora_a", "lora_b"], recurse=False)
        return m

    ref, mine = model(), model()
    ref_opt, my_opt = make_opt(), make_opt()
    update = compiled_update(mine, my_opt)
    frozen = {k: v for k, v in tree_flatten(mine.parameters()) if "lora" not in k}
    for i in range(4):
        grads = tree_map(lambda p: mx.random.normal(p.shape, key=mx.random.key(i)), ref.trainable_parameters())
        ref_opt.update(ref, grads)
        update(grads)
        mx.eval(ref.parameters(), mine.parameters(), ref_opt.state, my_opt.state)
        a, b = dict(tree_flatten(ref.trainable_parameters())), dict(tree_flatten(mine.trainable_parameters()))
        assert a.keys() == b.keys() and len(a) == 4
        assert max(mx.abs(a[k] - b[k]).max().item() / (mx.abs(a[k]).max().item() + 1e-30) for k in a) <= 1e-6
        sa, sb = dict(tree_flatten(ref_opt.state)), dict(tree_flatten(my_opt.state))
        assert sa.keys() == sb.keys()
        assert all(mx.allclose(sa[k], sb[k], rtol=1e-6, atol=1e-9).item() for k in sa)
    assert all(mx.array_equal(v, dict(tree_flatten(mine.parameters()))[k]).item() for k, v in frozen.items())
    assert max(mx.abs(a[k] - dict(tree_flatten(model().trainable_parameters()))[k]).max().item() for k in a) > 1e-4
