"""Where a server request's time goes, in process: the engine (``kimi_mlx.server.scheduler.Scheduler``) on
``bench_server.py``'s model and workload, without HTTP.

- agent: ``bench_server.py``'s 4-turn conversation (rendered as the server renders it: ``render_prompt``
  with the tools), each turn submitted after the previous one ends. Per turn: prompt and cached tokens, the prefill
  forward calls (tokens each: one call runs through the snapshot points in its ``prefill_chunk`` tokens, marked in
  the cache and taken after it), the time to the first token
  (submission to the first ``TokenEvent``; also the process's CPU time over it, steadier on shared cores) and the
  engine's time by phase up to it.
- clients: ``--clients`` throughput requests (``max_tokens`` ``--max-tokens``) submitted at once; tok/s (submission to
  the last event) and the engine's time by phase.

Phases are the scheduler's own steps, timed around their calls (wall time; the engine thread runs them in order):
``prefill`` (``_forward``: one prefill call, evaluated), ``snapshot`` (prefix-cache snapshots), ``restore``
(``cache_from_snapshot``), ``join`` (``merge_caches``: a prefilled row joins the batch), ``decode`` (``_step``: one
batched decode step, sampling included), ``leave`` (``HybridCache.filter``: finished rows leave). Rounds after the
first (``--rounds``) start a new conversation / new requests (the first round compiles and fills the system
snapshot). Also printed: the process's CPU time per round (steadier than wall time on shared cores).

``--baseline one-call-per-snapshot-point`` also runs, in every round before or after the current engine
(alternating), a second engine that prefills as the scheduler did before ``HybridCache.mark``: one forward call from
each snapshot point to the next (``SplitAtSnapshotPoints``); it prints each turn of both and, at the end, the median
over the rounds after the first of each turn's time to first token, current / baseline (wall and CPU).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python bench/profile_server.py
    LD_PRELOAD=... python bench/profile_server.py --clients 16 --rounds 3 --system-tokens 1000 --tool-tokens 300
    LD_PRELOAD=... python bench/profile_server.py --clients 0 --rounds 4 --baseline one-call-per-snapshot-point
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import TOOLS, Workload, served_model_dir  # noqa: E402
from bench_vs_mlx_lm import blas_in_use  # noqa: E402

import kimi_mlx.cache as cache_module  # noqa: E402
from kimi_mlx.loading import load  # noqa: E402
from kimi_mlx.server import scheduler as scheduler_module  # noqa: E402
from kimi_mlx.server.backend import Backend, render_prompt  # noqa: E402
from kimi_mlx.server.scheduler import GenerationRequest, Scheduler, TokenEvent  # noqa: E402

PHASES = [  # (owner, attribute, phase)
    (Scheduler, "_forward", "prefill"), (Scheduler, "_snapshot", "snapshot"),
    (scheduler_module, "cache_from_snapshot", "restore"), (scheduler_module, "merge_caches", "join"),
    (Scheduler, "_step", "decode"), (cache_module.HybridCache, "filter", "leave"),
]


class Clock:
    """Wall seconds and calls per phase; ``pieces``: the token count of each prefill call."""

    def __init__(self):
        self.seconds, self.calls, self.pieces = defaultdict(float), Counter(), []
        for owner, name, phase in PHASES:
            setattr(owner, name, self._timed(getattr(owner, name), phase))

    def _timed(self, fn, phase):
        def run(*args, **kw):
            if phase == "prefill":
                self.pieces.append(args[2])  # _forward(self, row, n)
            tic = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[phase] += time.perf_counter() - tic
                self.calls[phase] += 1
        return run

    def reset(self):
        self.seconds.clear(), self.calls.clear(), self.pieces.clear()

    def line(self) -> str:
        return ", ".join(f"{p} {self.seconds[p] * 1e3:.0f} ms/{self.calls[p]}" for _, _, p in PHASES if self.calls[p])


class SplitAtSnapshotPoints(Scheduler):
    """The scheduler before ``HybridCache.mark``: a prefill call ends at every snapshot point."""

    def _prefill(self) -> None:
        budget = self.prefill_chunk
        for row in list(self._waiting):
            end = len(row.request.tokens) - 1
            while row.done < end and budget > 0:
                stop = min((p for p in row.stops if p > row.done), default=end)
                n = min(stop - row.done, budget)
                self._forward(row, n)
                row.done += n
                budget -= n
                if row.done in row.stops:
                    self._snapshot(row.key[: row.done], row.cache, 0, row.stops[row.done])
            if row.done == end:
                self._waiting.remove(row)
                self._batch = row.cache if self._batch is None else scheduler_module.merge_caches(
                    [self._batch, row.cache], keep_row_pages=self.prefix_cache is not None)
                row.cache = None
                self._running.append(row)
            if budget <= 0:
                break


BASELINES = {"one-call-per-snapshot-point": SplitAtSnapshotPoints}


def request(tok, messages, max_tokens, tools=None) -> GenerationRequest:
    """``messages`` rendered as the server renders them (``render_prompt``: boundaries, system end)."""
    prompt = render_prompt(Backend(None, tok, "kimi_linear", len(tok), 1 << 20), messages, tools=tools)
    return GenerationRequest(prompt.tokens, max_tokens, boundaries=prompt.boundaries, system_end=prompt.system_end,
                             stop_token_ids=frozenset({tok.eos_token_id}))


def agent(engine, clock, tok, wl, rnd, turns, max_tokens, label="") -> list[tuple[float, float]]:
    """The agent conversation on ``engine``; per turn (time to first token, CPU seconds over it)."""
    times = []
    for k, messages in enumerate(wl.conversation(f"profile-{label}{rnd}-{time.time()}", turns)):
        req = request(tok, messages, max_tokens, TOOLS)
        clock.reset()
        tic, cpu = time.perf_counter(), time.process_time()
        stream, ttft = engine.submit(req), None
        for event in stream:
            if ttft is None and isinstance(event, TokenEvent):
                ttft, cpu, phases = time.perf_counter() - tic, time.process_time() - cpu, clock.line()
        print(f"  round {rnd}{label and ' ' + label} turn {k + 1}: prompt {len(req.tokens)}, cached "
              f"{stream.cached_tokens}, prefill calls {clock.pieces}; first token {ttft * 1e3:.0f} ms "
              f"(CPU {cpu * 1e3:.0f} ms): {phases}", flush=True)
        times.append((ttft, cpu))
    return times


def clients(engine, clock, tok, wl, rnd, n, max_tokens):
    reqs = [request(tok, wl.throughput_messages(f"profile-{rnd}", i), max_tokens) for i in range(n)]
    clock.reset()
    tic, cpu = time.perf_counter(), time.process_time()
    streams = [engine.submit(r) for r in reqs]
    tokens = sum(isinstance(e, TokenEvent) for s in streams for e in s)
    dt, cpu = time.perf_counter() - tic, time.process_time() - cpu
    print(f"  round {rnd} {n} clients: {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tok/s (CPU {cpu:.1f} s: "
          f"{tokens / cpu:.1f} tok per CPU s); {clock.line()}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--tool-tokens", type=int, default=300)
    ap.add_argument("--agent-max-tokens", type=int, default=16)
    ap.add_argument("--clients", type=int, default=16, help="concurrent throughput requests (0: none)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--baseline", choices=sorted(BASELINES), help="also run this earlier scheduler, interleaved")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path(os.environ.get("KIMI_BENCH_CACHE", Path.home() / ".cache" / "kimi_mlx_bench")))
    args = ap.parse_args(argv)
    print(f"BLAS: {blas_in_use()}")
    model_dir = served_model_dir(args.cache_dir)
    model, tok = load(model_dir)
    wl = Workload(model_dir, args.system_tokens, args.tool_tokens)
    clock = Clock()
    engines = [("", Scheduler(model, max_batch=max(args.clients, 1)).start())]
    if args.baseline:
        engines.append(("baseline", BASELINES[args.baseline](model, max_batch=max(args.clients, 1)).start()))
    ratios = defaultdict(list)  # turn -> [(wall ratio, CPU ratio)] current / baseline, rounds after the first
    try:
        for rnd in range(args.rounds):
            cpu, times = time.process_time(), {}
            for label, engine in engines[:: 1 if rnd % 2 else -1]:  # alternating order
                times[label] = agent(engine, clock, tok, wl, rnd, args.turns, args.agent_max_tokens, label)
                if args.clients:
                    clients(engine, clock, tok, wl, rnd, args.clients, args.max_tokens)
            if len(times) == 2 and rnd:
                for k, (mine, base) in enumerate(zip(times[""], times["baseline"])):
                    ratios[k + 1].append((mine[0] / base[0], mine[1] / base[1]))
            print(f"  round {rnd}: CPU {time.process_time() - cpu:.1f} s")
    finally:
        for _, engine in engines:
            engine.stop()
    for turn, rs in ratios.items():
        print(f"turn {turn}: first token current / {args.baseline}: wall {statistics.median(r[0] for r in rs):.2f}x, "
              f"CPU {statistics.median(r[1] for r in rs):.2f}x ({len(rs)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
