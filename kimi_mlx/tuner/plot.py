"""Loss-curve PNG from a run's metrics (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Union


def plot_loss_curve(records: list[dict], out: Union[str, Path], title: str = "kimi-mlx lora") -> Path:
    """Train loss (and validation loss when present) against the iteration, written to ``out`` (PNG).

    ``records``: the run's metrics records (``{"iteration", "train_loss"}`` and/or ``{"iteration", "val_loss"}``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["iteration"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        raise ValueError("no train_loss / val_loss records to plot")
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if train:
        ax.plot(*zip(*train), marker="o", markersize=3, label="train loss")
    if val:
        ax.plot(*zip(*val), marker="s", markersize=4, linestyle="--", label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
