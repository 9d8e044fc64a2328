"""Data-parallel LoRA (``train(..., group=)``, ``mlx.launch -n 2 -- kimi-mlx lora ...``): two ring ranks, each taking
half of every global batch, train like one process on the whole batch.

The data has sequences of different lengths and prompt masks, so the two halves of a batch have different numbers of
loss tokens (gradients and losses must be weighted by tokens, not averaged per rank); the ranks start from different
adapters and seeds (rank 0's must win); gradient accumulation and validation run too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from conftest import KL_FIXTURE
from distributed import launch_command, run_ranks
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import TrainingArgs, iterate_batches

from kimi_mlx.demo import demo_model_path
from kimi_mlx.loading import load_model
from kimi_mlx.tuner.adapters import apply_adapters, select_modules
from kimi_mlx.tuner.trainer import train

# 2 ranks vs one process, float32, SGD: per-iteration train losses, validation losses and final adapter weights.
# Measured: train losses differ by <= 9.5e-7 (6.43 falling to 5.54), validation losses by <= 2.4e-6, adapter weights
# by <= 3.7e-7, the CLI's loss curve (demo model) by <= 3.1e-6: only the order of float32 sums differs (each rank's
# matmuls over half the rows, the weighted all_sum). (Not Adam: its first updates are ~lr * sign(gradient), so
# gradient entries near 0 turn that rounding into weight differences up to lr; with Adam lr 1e-3 the losses still
# agree to 2.4e-6 but single weights by 3e-5.)
TOL = 1e-5

BATCH, ITERS, ACCUM = 4, 6, 2


def sequences(n: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` random (tokens, prompt length) pairs of 10-40 tokens, the first 0-8 of them prompt (no loss)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(10, 41))
        out.append(([int(t) for t in rng.integers(1, 500, length)], int(rng.integers(0, 9))))
    return out


TRAIN, VALID = sequences(12, 0), sequences(8, 1)


def build(seed: int):
    """The float32 Kimi Linear fixture with rank-4 LoRA on its KDA, MLA and expert projections, initialized from
    ``seed``."""
    model, _ = load_model(KL_FIXTURE / "hf", dtype=mx.float32)
    mx.random.seed(seed)
    apply_adapters(model, list(select_modules(model, ["kda", "mla", "experts"])), rank=4, scale=5.0)
    return model


def run_training(model, out_dir: Path, seed: int, group=None, batch_size: int = BATCH):
    """``train`` for ITERS iterations (ACCUM-step accumulation, a report every iteration, validation on one of the two
    validation batches at 1, 3 and 6, a checkpoint at 4) -> (records, logged lines)."""
    args = TrainingArgs(
        batch_size=batch_size,
        iters=ITERS,
        grad_accumulation_steps=ACCUM,
        steps_per_report=1,
        steps_per_eval=3,
        val_batches=1,
        steps_per_save=4,
        max_seq_length=64,
        adapter_file=str(out_dir / "adapters.safetensors"),
    )
    lines = []
    optimizer = optim.SGD(learning_rate=0.5)
    records = train(model, optimizer, TRAIN, VALID, args, out_dir, seed=seed, progress=False, log=lines.append,
                    group=group)
    return records, lines


RANK_SCRIPT = """
from pathlib import Path
import numpy as np
from mlx.utils import tree_flatten
sys.path.insert(0, sys.argv[1])
from test_parallel_lora import build, run_training

rank = group.rank()
out = Path(f"ad{rank}")
out.mkdir()
model = build(seed=10 + rank)                      # different adapters on each rank: rank 0's must be used
try:
    run_training(model, out, seed=0, group=group, batch_size=3)
    error = None
except ValueError as e:
    error = str(e)
np.random.seed(100 + rank)                          # numpy (validation batches) and the seed given to train differ
records, lines = run_training(model, out, seed=3 + 7 * rank, group=group)   # too: rank 0's seed must be used
mx.save_safetensors(f"final{rank}.safetensors", dict(tree_flatten(model.trainable_parameters())))

from kimi_mlx.tuner.trainer import global_share
shares = {}
for name, parts in {"weighted": [(2.0, 3, [1.0, 2.0]), (4.0, 1, [8.0, -4.0])],
                    "no tokens on rank 1": [(2.0, 3, [1.0, 2.0]), (float("nan"), 0, [float("nan")] * 2)]}.items():
    lvalue, toks, grad = parts[rank]
    loss, total, share = global_share(mx.array(lvalue), mx.array(toks), {"w": mx.array(grad)}, group)
    shares[name] = [loss.item(), total.item(), mx.distributed.all_sum(share["w"], group=group).tolist()]
report({"records": records, "lines": lines, "error": error, "files": sorted(p.name for p in out.iterdir()),
        "shares": shares})
"""


def completion_tokens(rank: int) -> list[int]:
    """Tokens after the prompt in rank ``rank``'s half of each global batch of TRAIN (2 ranks)."""
    half = SimpleNamespace(rank=lambda: rank, size=lambda: 2)
    batches = iterate_batches(TRAIN, BATCH, 64, comm_group=half)
    return [int((lengths[:, 1] - lengths[:, 0]).sum()) for _, lengths in batches]


def train_losses(records):
    return [r["train_loss"] for r in records if "train_loss" in r]


def val_losses(records):
    return [r["val_loss"] for r in records if "val_loss" in r]


def iter_lines(lines):
    """The "Iter N: Train/Val ..." lines, up to the kind of line."""
    return [line.split()[:3] for line in lines if line.startswith("Iter")]


def test_two_ranks_train_like_one_process(tmp_path):
    """Per-iteration train losses, validation losses and final adapters of 2 ranks equal one process on the same
    global batches within TOL; token counts exactly; both ranks hold bit-identical adapters; only rank 0 logs and
    writes files; a global batch that 2 ranks cannot split is an error naming --batch-size and the rank count."""
    halves = [completion_tokens(rank) for rank in range(2)]  # the halves of each global batch differ in tokens
    assert all(a != b for a, b in zip(*halves)), halves

    ranks = run_ranks(RANK_SCRIPT, 2, tmp_path / "ranks", args=[Path(__file__).parent], timeout=120)
    single_dir = tmp_path / "single"
    single_dir.mkdir()
    model = build(seed=10)
    np.random.seed(3)  # train seeds numpy only with several ranks
    single, single_lines = run_training(model, single_dir, seed=3)
    expected = dict(tree_flatten(model.trainable_parameters()))

    for rank, r in enumerate(ranks):
        # loss and gradient weighted by tokens: (3 * 2 + 1 * 4) / 4, (3 * [1, 2] + 1 * [8, -4]) / 4
        assert r["shares"] == {"weighted": [2.5, 4, [2.75, 0.5]], "no tokens on rank 1": [2.0, 3, [1.0, 2.0]]}
        assert r["error"] and "--batch-size 3" in r["error"] and "2 ranks" in r["error"], r["error"]
        assert [x["trained_tokens"] for x in r["records"] if "trained_tokens" in x] == [
            x["trained_tokens"] for x in single if "trained_tokens" in x
        ]
        loss_diff = np.abs(np.array(train_losses(r["records"])) - train_losses(single)).max()
        val_diff = np.abs(np.array(val_losses(r["records"])) - val_losses(single)).max()
        print(f"rank {rank}: train loss diff {loss_diff:.2e}, val loss diff {val_diff:.2e}")
        assert len(train_losses(r["records"])) == ITERS and len(val_losses(r["records"])) == 3
        assert loss_diff <= TOL and val_diff <= TOL
    assert train_losses(single)[-1] < train_losses(single)[0] - 0.5  # it trains

    finals = [mx.load(str(tmp_path / "ranks" / f"final{rank}.safetensors")) for rank in range(2)]
    saved = mx.load(str(tmp_path / "ranks" / "ad0" / "adapters.safetensors"))
    assert finals[0].keys() == finals[1].keys() == saved.keys() == expected.keys()
    weight_diff = max(mx.abs(finals[0][k] - expected[k]).max().item() for k in expected)
    print(f"adapter weight diff {weight_diff:.2e}")
    assert weight_diff <= TOL
    assert all(mx.array_equal(finals[0][k], finals[1][k]).item() for k in expected)
    assert all(mx.array_equal(finals[0][k], saved[k]).item() for k in expected)

    lead, other = ranks
    assert iter_lines(lead["lines"]) == iter_lines(single_lines)
    assert sum(line.startswith("Iter 6: Train loss") for line in lead["lines"]) == 1
    assert other["lines"] == [] and other["files"] == []
    assert set(lead["files"]) == {"adapters.safetensors", "0000004_adapters.safetensors", "metrics.jsonl",
                                  "loss_curve.png"}


def run_launched(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher line; on timeout kill its whole process group (a rank left waiting in a collective when the
    other failed would outlive the launcher) and fail with what it printed."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out[-4000:]}\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def lora_command(tmp_path: Path, n: int, *flags: str) -> list[str]:
    """``kimi-mlx lora`` on the demo model and data under ``mlx.launch -n N`` (pinned ranks); each rank writes its
    exit status to ``rc.RANK`` (the launcher may exit 0 when a rank fails)."""
    kimi = shutil.which("kimi-mlx", path=os.path.dirname(sys.executable))
    script = '"$0" "$@"; echo $? > rc.$MLX_RANK'
    return launch_command(n, tmp_path, "bash", "-c", script, kimi, "lora", "--model", "demo", "--data", "demo", *flags)


def rank_status(tmp_path: Path, n: int) -> list:
    """Each rank's exit status (None: it wrote none)."""
    files = [tmp_path / f"rc.{rank}" for rank in range(n)]
    return [int(f.read_text()) if f.exists() else None for f in files]


def cli_flags(batch_size: int = 4) -> list[str]:
    """Train 4 iterations with SGD (reports at 2 and 4, validation on 2 of the 4 batches at 1 and 4), then test;
    48-token sequences."""
    return [
        "--train", "--mask-prompt", "--iters", "4", "--batch-size", str(batch_size), "--optimizer", "sgd",
        "--learning-rate", "3e-3", "--steps-per-report", "2", "--steps-per-eval", "4", "--val-batches", "2",
        "--max-seq-length", "48", "--test", "--test-batches", "2", "--adapter-path", "ad", "--quiet",
    ]  # fmt: skip


def printed_test_loss(stdout: str) -> float:
    return float(stdout.split("Test loss ")[1].split(",")[0])


def metrics_losses(adapter_dir: Path) -> list[tuple[int, float]]:
    """(iteration, train or validation loss) of each record in ``metrics.jsonl``."""
    records = [json.loads(line) for line in (adapter_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["iteration"], r.get("train_loss", r.get("val_loss"))) for r in records]


def test_cli_under_mlx_launch(tmp_path):
    """``mlx.launch -n 2 -- kimi-mlx lora --train --test ...``: both ranks exit 0; rank 0 alone prints (one set of
    "Iter" lines, the rank count, one test loss) and writes the adapter files; its loss curve equals a one-process
    run's within TOL. An odd --batch-size makes every rank exit 2 with an error naming it and the rank count."""
    demo_model_path()  # written once here: two ranks writing it at once race (kimi_mlx/demo.py)
    run = run_launched(lora_command(tmp_path, 2, *cli_flags()), tmp_path, timeout=120)
    assert rank_status(tmp_path, 2) == [0, 0], run.stdout + run.stderr
    out = run.stdout
    assert out.count("Data-parallel training on 2 ranks: global batch 4, 2 per rank") == 1, out
    for line in ("Trainable parameters", "Iter 1: Val loss", "Iter 2: Train loss", "Iter 4: Train loss",
                 "Iter 4: Val loss", "Saved final weights", "Test loss"):
        assert out.count(line) == 1, (line, out)
    assert {p.name for p in (tmp_path / "ad").iterdir()} == {"adapters.safetensors", "adapter_config.json",
                                                             "metrics.jsonl", "loss_curve.png"}

    single = tmp_path / "single"
    single.mkdir()
    cmd = [sys.executable, "-m", "kimi_mlx.cli.main", "lora", "--model", "demo", "--data", "demo", *cli_flags()]
    one = subprocess.run(cmd, cwd=single, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    assert "Data-parallel" not in one.stdout
    ranked, alone = metrics_losses(tmp_path / "ad"), metrics_losses(single / "ad")
    assert [it for it, _ in ranked] == [it for it, _ in alone] == [1, 2, 4, 4]
    diff = max(abs(a - b) for (_, a), (_, b) in zip(ranked, alone))
    print(f"CLI loss curve diff {diff:.2e}")
    assert diff <= TOL
    assert abs(printed_test_loss(out) - printed_test_loss(one.stdout)) <= 1.5e-3  # printed with 3 decimals

    bad = tmp_path / "bad"
    bad.mkdir()
    run = run_launched(lora_command(bad, 2, *cli_flags(batch_size=3)), bad, timeout=60)
    assert rank_status(bad, 2) == [2, 2], run.stdout + run.stderr
    assert "--batch-size 3 is the global batch and must be divisible by the 2 ranks" in run.stderr
    assert not (bad / "ad").exists()
