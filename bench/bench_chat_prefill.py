"""Chat turn prefill with the session's cache reuse vs re-prefilling the whole conversation.

Builds the benchmark Kimi Linear of ``bench_vs_mlx_lm.py`` (hidden 768, 12 layers, KDA:MLA 3:1; written once under
``~/.cache/kimi_mlx_bench/``) with the demo model's byte-level tokenizer, has a ``ChatSession`` hold a conversation of
``--turns`` exchanges (user messages of ``--user-tokens`` bytes, greedy replies of ``--reply-tokens``), then times the
next turn's prefill (until the first reply token) two ways, alternating within each round:

- session: ``ChatSession.send`` (prefills only the new message; the cache rolls back with ``/undo`` between rounds);
- full: the same rendered prompt through ``stream_generate`` on a fresh cache (what a stateless client does).

    python bench/bench_chat_prefill.py                     # 4 turns, 400-token messages, 5 rounds
    python bench/bench_chat_prefill.py --turns 8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_mlx_lm import CONFIG, blas_in_use, checkpoint_dir, describe, load_kimi  # noqa: E402

from kimi_mlx import load  # noqa: E402
from kimi_mlx.chat.session import ChatSession  # noqa: E402
from kimi_mlx.generate import stream_generate  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def message(n_bytes: int, seed: int) -> str:
    """A plain-text user message of about ``n_bytes`` bytes (one token per byte with the demo tokenizer)."""
    out, i = [], seed
    while sum(len(w) + 1 for w in out) < n_bytes:
        out.append(WORDS[(i * 7 + 3) % len(WORDS)])
        i += 1
    return " ".join(out)[:n_bytes]


def timed(events) -> float:
    """Seconds to run a one-token reply to the end (prefill + the first token; the same extra work both ways)."""
    tic = time.perf_counter()
    for _ in events:
        pass
    return time.perf_counter() - tic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=4, help="exchanges before the measured turn")
    ap.add_argument("--user-tokens", type=int, default=400)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (median), after one warm-up round")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("KIMI_BENCH_CACHE", Path.home() / ".cache" / "kimi_mlx_bench")))
    args = ap.parse_args(argv)

    model = load_kimi(checkpoint_dir(args.cache_dir), mx.float32)
    _, tokenizer = load("demo")
    print(f"BLAS: {blas_in_use()}")
    print(f"model: {describe(CONFIG)}, float32, {mx.default_device()}")
    # random weights over an 8192 vocabulary: keep replies to printable ASCII so they re-render to the same tokens
    printable = mx.where((mx.arange(CONFIG["vocab_size"]) >= 32) & (mx.arange(CONFIG["vocab_size"]) < 127), 0.0, -1e9)
    sampling = {"logits_processors": [lambda tokens, logits: logits + printable]}
    session = ChatSession(model, tokenizer, max_tokens=args.reply_tokens, max_checkpoints=8, sampling=sampling)
    for t in range(args.turns):
        for _ in session.send(message(args.user_tokens, t)):
            pass
    history = len(session.tokens)

    def one_round(r: int) -> tuple[float, float, int]:
        """(session seconds, full re-prefill seconds, prompt tokens) for a fresh question (a repeated one would be
        served from the previous round's checkpoint)."""
        question = message(args.user_tokens, 100 + r)
        session.messages.append({"role": "user", "content": question})
        prompt = session.render()
        session.messages.pop()
        s = timed(session.send(question, max_tokens=1))
        st = session.last.stats
        assert (st.reused_tokens, st.prefill_tokens) == (history, len(prompt) - history), st
        session.undo()
        f = timed(stream_generate(model, tokenizer, prompt, 1, prompt_cache=model.make_cache(), **sampling))
        return s, f, len(prompt)

    one_round(-1)  # warm-up
    rounds = [one_round(r) for r in range(args.rounds)]
    s, f = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
    total = int(statistics.median(r[2] for r in rounds))
    new = total - history
    print(f"conversation: {args.turns} exchanges, {history} tokens cached; turn {args.turns + 1} prompt "
          f"{total} tokens (median), {new} of them new")
    print(f"session (prefill {new} new tokens):      median {s * 1e3:8.1f} ms  ({new / s:7.1f} tok/s)")
    print(f"full re-prefill ({total} tokens):  median {f * 1e3:8.1f} ms  ({total / f:7.1f} tok/s)")
    print(f"speed-up: {f / s:.1f}x over {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
