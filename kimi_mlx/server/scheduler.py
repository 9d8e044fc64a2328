"""Continuous batching over one model: requests join a shared decode batch between steps and leave when done.

One engine thread owns the model and the caches. Each loop turn it
1. takes new requests and cancellations (``submit`` / ``RequestStream.cancel`` from any thread);
2. prefills waiting requests, up to ``prefill_chunk`` tokens per turn in all, each in its own one-row cache that
   starts from the longest prefix-cache snapshot of its prompt (``PrefixCache``); snapshots are taken at message
   boundaries, at the end of the system prompt, every ``checkpoint_interval`` tokens and at the prompt's end (all
   but its last token), which stands for the end of the last message: one prefill forward call runs through the
   snapshot points in its tokens (``HybridCache.mark``: the KDA layers keep their state there) and the snapshots
   are taken after it, so the new tokens of a re-sent conversation go in as one long call;
3. a request whose prompt (all but its last token) is in its cache joins the batch (``merge_caches``: rows
   left-padded to a common length); its last prompt token is its first decode input;
4. runs one decode step for the whole batch ``[B, 1]`` and samples each row with its own settings
   (``RowSampler``), except rows whose reasoning budget ran out (``ReasoningBudget``), which are given the tokens
   that close the section, one per step; or, when the batch can speculate (below), one speculative pass;
5. finished and cancelled rows leave (``HybridCache.filter``), a finished row's cache becomes a "reply" snapshot,
   so the next turn of the conversation starts from it.

So running streams keep flowing while new prompts prefill in chunks. The scheduler deals in token ids only; text,
stop strings and chat formats belong to the HTTP layer.

Speculation (``draft``: "lookup" or a draft model; or a request's ``prediction``): a decode turn is one speculative
pass (``kimi_mlx.speculative.verify_step``: the row's last token and up to k drafts verified in one forward pass,
accepted by the row's own sampling rule and logits processors, the rejected suffix rolled back) when the batch has
at most ``draft_max_batch`` rows and each of them can speculate: it asked for it (``GenerationRequest.speculative``,
and the server has a drafter or the request a prediction) and is not being given its reasoning section's closer.
Any other turn is the plain batched step. Each row keeps its drafter (lookup: over its prompt, its reply and its
prediction; a draft model: its own cache, which the drafter brings to the row's history when speculation resumes)
and its adaptive length (``DraftLength``), so rows join and leave as without speculation. A pass's tokens are cut at
the first stop token (the cache keeps what was emitted, so the reply snapshot is exact); the draft length is capped
by ``max_tokens`` and by what the reasoning budget allows. ``draft_max_batch`` is 1: decoding one row is bound by
reading the weights, so verifying k more tokens costs little; with more rows the batch already shares the weight
reads, and a verify pass over several rows would need a per-row rollback of the batch cache (the rows' accepted
lengths differ), which is not built.

Images: a request's prompt holds each image's placeholders and ``images`` its ``PromptImage``s (prepared, i.e.
decoded and preprocessed, by the caller). A prefill chunk that overlaps placeholders goes in as embeddings with the
image features in place (``ImageRows.embed``; features from ``model.image_encoder``, on this thread, cached by
digest); a chunk may end inside an image. The prefix cache is keyed by ``ImageRows.key`` (each placeholder replaced
by its image's content id), so two different images never share an entry and the same image re-sent resumes.

Distributed (``group`` of a ``--parallel`` model): every rank runs the engine loop in lockstep; only rank 0 takes
requests. Each turn starts with rank 0's plan (``_Plan``: requests admitted with their resolved seed and the prefix
snapshot to start from, requests cancelled, snapshots evicted), broadcast as JSON; every decision that could differ
between ranks is rank 0's, and the sampled tokens are rank 0's too (broadcast every step). A speculative turn is
decided from state every rank shares; its drafts are rank 0's (only rank 0 runs drafters; broadcast), and so are
the accepted count and tokens (broadcast after the pass), so every rank rolls back the same suffix.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Optional, Union

import mlx.core as mx

from ..cache import HybridCache, cache_from_snapshot, check_kv_quant, merge_caches
from ..image_prompt import ImageRows, PromptImage
from ..parallel import comm
from ..sampling import SamplingParams
from ..speculative import DraftLength, DraftModel, PromptLookup, TargetSampling, propose_drafts, rollback, verify_step
from .prefix_cache import PrefixCache
from .sampling import RowSampler, top_logprobs

__all__ = ["EngineStoppedError", "FinishEvent", "GenerationRequest", "QueueFullError", "ReasoningBudget",
           "RequestStream", "SamplingParams", "Scheduler", "TokenEvent"]


@dataclass(frozen=True)
class ReasoningBudget:
    """At most ``tokens`` reasoning tokens in a reply whose prompt opened the reasoning section: the section ends
    at the first generated token in ``ends`` (the format's markers, the stop tokens); a row that generated
    ``tokens`` tokens without one is given ``close`` (the tokens that close the section and open the answer) as its
    next tokens, one per step, and then samples on."""

    tokens: int
    close: tuple[int, ...]
    ends: frozenset


@dataclass
class GenerationRequest:
    """tokens: the whole prompt (validated by the caller: non-empty, ids < vocab). stop_token_ids: generation stops
    after one of them (it is reported). top_logprobs: None none, 0 the chosen token's, k also the k most likely.
    boundaries: prompt positions that end a message (snapshot points but the last, the end of the last
    message, which the snapshot at the prompt's end stands for); system_end: end of the system prompt and
    tool declarations (a snapshot shared across conversations), 0 for none. reasoning: the reply's reasoning
    budget (every rank follows it: whether a turn speculates depends on it). images: the ``PromptImage``s whose
    placeholders ``tokens`` holds, in prompt order. prediction: ids the reply is expected to repeat (a draft source:
    the request speculates with prompt lookup over its prompt, reply and prediction); speculative: False turns
    speculation off for this request. ``sampling.sampler`` is refused: each row draws with its own key
    (``RowSampler``)."""

    tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset = frozenset()
    top_logprobs: Optional[int] = None
    boundaries: tuple = ()
    system_end: int = 0
    reasoning: Optional[ReasoningBudget] = None
    images: tuple = ()
    prediction: tuple = ()
    speculative: bool = True

    def __post_init__(self) -> None:
        if self.sampling.sampler is not None:
            raise ValueError("sampling: the scheduler does not take a sampler (each request draws with its own key)")


@dataclass
class TokenEvent:
    token: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list] = None  # [(token id, logprob)], most likely first


@dataclass
class FinishEvent:
    """reason: "stop" (the last token was a stop token), "length", "cancelled" or "error" (``error`` says what).
    drafted / accepted: draft tokens verified for this request, and those of them in the reply."""

    reason: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    error: Optional[str] = None
    drafted: int = 0
    accepted: int = 0


Event = Union[TokenEvent, FinishEvent]


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (stopped, or failed: the message says why)."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_queue``; ``retry_after`` seconds is a guess of when a slot frees."""

    def __init__(self, waiting: int, retry_after: float):
        super().__init__(f"server busy: {waiting} requests are waiting; retry in {retry_after:.0f} s")
        self.retry_after = retry_after


class RequestStream:
    """The events of one request, readable from a thread (``for ev in stream``) or an event loop (``async for``).

    cached_tokens: prompt tokens taken from the prefix cache (set before the first event is delivered).
    """

    def __init__(self, request: GenerationRequest, loop: Optional[asyncio.AbstractEventLoop], silent: bool = False):
        self.request = request
        self.cached_tokens = 0
        self.cancelled = False
        self.submitted = time.perf_counter()
        self._silent = silent  # a non-zero rank's copy: nobody reads its events
        self._events: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._loop = loop
        self._ready = asyncio.Event() if loop is not None else None

    def cancel(self) -> None:
        """Stop generating (within one step); the stream ends with a "cancelled" FinishEvent. Idempotent."""
        self.cancelled = True

    def _put(self, event: Event) -> None:
        if self._silent:
            return
        with self._cond:
            self._events.append(event)
            self._cond.notify()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the client's event loop is gone: nobody is listening
                self.cancelled = True

    def __iter__(self) -> Iterator[Event]:
        while True:
            with self._cond:
                while not self._events:
                    self._cond.wait()
                event = self._events.popleft()
            yield event
            if isinstance(event, FinishEvent):
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        if self._ready is None:
            raise RuntimeError("this stream was submitted outside an event loop: iterate it with `for`")
        while True:
            while self._events:
                event = self._events.popleft()
                yield event
                if isinstance(event, FinishEvent):
                    return
            self._ready.clear()
            if not self._events:
                await self._ready.wait()


def _request_to_json(req: GenerationRequest) -> dict:
    d = {k: getattr(req, k) for k in ("tokens", "max_tokens", "top_logprobs", "boundaries", "system_end")}
    d["stop_token_ids"] = sorted(req.stop_token_ids)
    d["sampling"] = req.sampling.to_json()
    d["images"] = [im.to_json() for im in req.images]
    d["speculates"] = req.speculative and bool(req.prediction)  # with a prediction: speculates without --draft
    d["speculative"] = req.speculative
    budget = req.reasoning
    d["reasoning"] = None if budget is None else [budget.tokens, list(budget.close), sorted(budget.ends)]
    return d


def _request_from_json(d: dict) -> GenerationRequest:
    """A rank's copy of rank 0's request; its ``prediction`` is a stand-in (only rank 0 drafts): it says whether
    the request speculates."""
    return GenerationRequest(d["tokens"], d["max_tokens"], SamplingParams.from_json(d["sampling"]),
                             frozenset(d["stop_token_ids"]), d["top_logprobs"], tuple(d["boundaries"]), d["system_end"],
                             reasoning=ReasoningBudget(d["reasoning"][0], tuple(d["reasoning"][1]),
                                                       frozenset(d["reasoning"][2])) if d["reasoning"] else None,
                             images=tuple(PromptImage.from_json(im) for im in d["images"]),
                             prediction=(0,) if d["speculates"] else (), speculative=d["speculative"])


def _target(params: SamplingParams) -> Optional[TargetSampling]:
    """The distribution a request samples from (None: greedy)."""
    return TargetSampling(params.temp, params.top_p, params.min_p, params.top_k) if params.temp > 0 else None


def _cache_key(rows: Optional[ImageRows], tokens: list[int]) -> list[int]:
    """``tokens`` as a prefix-cache key: each image placeholder replaced by its image's content id (``key_id``)."""
    return rows.key(tokens) if rows is not None else list(tokens)


@dataclass
class _Plan:
    """What every rank does this turn: admit these requests (id, request, prefix entry id or None), drop the
    cancelled ids, remove evicted prefix snapshots, or stop serving."""

    admit: list = field(default_factory=list)
    cancel: list = field(default_factory=list)
    evict: list = field(default_factory=list)
    stop: bool = False

    def empty(self) -> bool:
        return not (self.admit or self.cancel or self.evict or self.stop)


@dataclass
class _Row:
    """A request inside the engine: its stream, its one-row cache while prefilling, its sampler, where it is in its
    reasoning budget, its images' placeholders (``rows``), its prompt as a prefix-cache key (``key``) and, when it
    speculates, its draft length (every rank), its drafter (rank 0) and its counts of drafted / accepted tokens."""

    id: int
    stream: RequestStream
    sampler: RowSampler
    rows: Optional[ImageRows] = None
    key: list = field(default_factory=list)  # the prompt with each placeholder as its image's key_id
    cache: Optional[HybridCache] = None
    done: int = 0  # prompt tokens in the cache (prefill progress)
    stops: dict = field(default_factory=dict)  # prompt position -> snapshot kind taken there
    next_input: int = 0
    generated: list = field(default_factory=list)
    cancelled: bool = False  # decided in a plan (the stream's flag is set from any thread, at any time)
    reasoning_left: Optional[int] = None  # reasoning tokens the budget still allows (None: no budget, or done)
    forced: list = field(default_factory=list)  # the next tokens, given instead of sampled
    length: Optional[DraftLength] = None  # None: this row does not speculate
    drafter: Optional[object] = None  # a Drafter (rank 0 only)
    drafted: int = 0
    accepted: int = 0

    def draft_limit(self) -> int:
        """Most drafts the next pass may verify: the adaptive length, capped so that the pass's tokens (drafts + 1)
        fit ``max_tokens`` and, inside a reasoning budget, end by the last reasoning token it allows."""
        k = min(self.length.next_length(), self.request.max_tokens - len(self.generated) - 1)
        if self.reasoning_left is not None:
            k = min(k, self.reasoning_left - 1)
        return max(k, 0)

    @property
    def request(self) -> GenerationRequest:
        return self.stream.request

    def follow_budget(self, token: int) -> None:
        """Advance the reasoning budget past ``token``: a given token is used up; a token that ends the section
        ends the budget; a reasoning token counts, and the last one allowed queues the section's closer."""
        if self.forced:
            self.forced.pop(0)
        elif self.reasoning_left is not None:
            budget = self.request.reasoning
            if token in budget.ends:
                self.reasoning_left = None
                return
            self.reasoning_left -= 1
            if self.reasoning_left == 0:
                self.reasoning_left, self.forced = None, list(budget.close)


class Scheduler:
    """Continuous batching for ``model`` (see the module doc).

    max_batch: rows decoded together; max_queue: requests waiting beyond those; prompt_cache_bytes: the prefix
    cache's byte budget (0 disables it); prefill_chunk: prompt tokens prefilled per loop turn; checkpoint_interval:
    snapshot spacing inside long prompts (0: only at message boundaries); group: the model's distributed group;
    kv_bits / kv_group_size: every row's MLA latent cache is quantized (so are its snapshots and merged batches).
    draft: None (speculation only for requests with a prediction), "lookup" or a draft model (a Kimi model sharing
    the tokenizer; ``kimi_mlx.speculative.DraftModel`` per row); num_draft_tokens: the most drafts per pass;
    draft_max_batch: speculate while the batch has at most this many rows (1: see the module doc).
    """

    def __init__(self, model, *, max_batch: int = 16, max_queue: int = 64, prompt_cache_bytes: int = 2 << 30,
                 prefill_chunk: int = 512, checkpoint_interval: int = 4096,
                 group: Optional[mx.distributed.Group] = None, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                 draft=None, num_draft_tokens: int = 8, draft_max_batch: int = 1):
        if max_batch < 1 or max_queue < 0 or prefill_chunk < 1 or checkpoint_interval < 0:
            raise ValueError("max_batch and prefill_chunk must be >= 1, max_queue and checkpoint_interval >= 0")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if draft_max_batch != 1:
            raise ValueError(f"draft_max_batch {draft_max_batch}: only 1 is supported (a verify pass over several "
                             "rows needs a per-row rollback of the batch cache, which is not built)")
        if isinstance(draft, str) and draft != "lookup":
            raise ValueError(f"draft must be None, 'lookup' or a draft model, got {draft!r}")
        check_kv_quant(kv_bits, kv_group_size)
        # every row's cache (quantized from the start); none: the model's plain make_cache()
        self.kv = {"kv_bits": kv_bits, "kv_group_size": kv_group_size} if kv_bits is not None else {}
        self.model = model
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_chunk, self.checkpoint_interval = prefill_chunk, checkpoint_interval
        self.group = group if group is not None and group.size() > 1 else None
        self.leader = self.group is None or self.group.rank() == 0
        self.draft, self.num_draft_tokens, self.draft_max_batch = draft, num_draft_tokens, draft_max_batch
        self._drafted = self._accepted = self._passes = 0
        self.prefix_cache = None
        if prompt_cache_bytes > 0:  # the other ranks drop what rank 0 evicts, when it says so
            self.prefix_cache = PrefixCache(prompt_cache_bytes if self.leader else None)
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._ids = iter(range(1 << 62))
        self._waiting: list[_Row] = []  # admitted, prefilling
        self._running: list[_Row] = []  # in the decode batch, row i of self._batch
        self._batch: Optional[HybridCache] = None
        self._evicted: list[int] = []
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.failure: Optional[str] = None  # why the engine loop ended, if it failed
        self._finished = 0
        self._durations = collections.deque(maxlen=64)  # seconds per finished request, for Retry-After

    # ---- any thread -------------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue ``request``; its events arrive on the returned stream. Raises QueueFullError when full, ValueError
        for images the model cannot take (no vision tower) or a prompt whose placeholders do not match its images."""
        if not self.leader:
            raise RuntimeError("requests go to rank 0")
        self._image_rows(request)  # ValueError: images this model cannot take, or placeholders that do not match
        if self.failure is not None or self._stopping:
            raise EngineStoppedError(f"the engine is not running ({self.failure or 'stopped'})")
        waiting = len(self._inbox) + len(self._waiting) + len(self._running) - self.max_batch
        if waiting >= self.max_queue:
            typical = sorted(self._durations)[len(self._durations) // 2] if self._durations else 1.0
            raise QueueFullError(waiting, max(1.0, typical))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        stream = RequestStream(request, loop)
        self._inbox.append(stream)
        self._wake.set()
        return stream

    def start(self) -> "Scheduler":
        """Run the engine loop on a thread (rank 0); see ``serve`` for the other ranks."""
        self._thread = threading.Thread(target=self._serve_thread, name="kimi-mlx-engine", daemon=True)
        self._thread.start()
        return self

    def _serve_thread(self) -> None:
        try:
            self.serve()
        finally:
            # MLX's streams belong to the thread that made them: a thread must release its own before it ends, or
            # tearing them down at interpreter exit can abort the process
            mx.synchronize()
            mx.clear_streams()

    def stop(self) -> None:
        """Finish serving: requests in flight end with an "error" event; every rank's loop returns."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def stats(self) -> dict:
        """Rows running / prefilling / queued, requests finished, the prefix cache's stats, ``images_encoded``
        (vision tower runs; None without a tower) and ``speculation``: the server's drafter (None, "lookup",
        "model"), speculative passes run, draft tokens verified and accepted (all requests so far)."""
        encoder = getattr(self.model, "image_encoder", None)
        drafter = self.draft if self.draft is None or isinstance(self.draft, str) else "model"
        return {"running": len(self._running), "prefilling": len(self._waiting), "queued": len(self._inbox),
                "finished": self._finished,
                "prefix_cache": self.prefix_cache.stats() if self.prefix_cache is not None else None,
                "images_encoded": encoder.encoded if encoder is not None else None,
                "speculation": {"draft": drafter, "passes": self._passes, "drafted": self._drafted,
                                "accepted": self._accepted}}

    def _image_rows(self, req: GenerationRequest) -> Optional[ImageRows]:
        """``req``'s placeholders lined up with its images; None for a model without a vision tower (which takes
        no images: ValueError if the request has some). ValueError when placeholders and images do not match."""
        encoder = getattr(self.model, "image_encoder", None)
        if encoder is None:
            if req.images:
                raise ValueError(getattr(self.model, "no_images_reason", "this model takes no images"))
            return None
        return ImageRows(req.tokens, req.images, encoder.placeholder_id)

    # ---- the engine loop --------------------------------------------------------------------------------------
    def serve(self) -> None:
        """The engine loop, until ``stop()`` (rank 0) or rank 0's stop plan (the other ranks, which call this).

        A failure inside a turn ends the requests in flight with an "error" event and serving goes on; a failure
        to exchange plans (a rank is gone) ends every request and the loop, and later ``submit`` calls fail."""
        try:
            while True:
                if self.leader and not (self._inbox or self._waiting or self._running or self._stopping):
                    self._wake.wait(0.05)
                    self._wake.clear()
                plan = self._share(self._plan() if self.leader else None)
                if plan.stop:
                    break
                self._apply(plan)
                try:
                    self._prefill()
                    self._decode()
                except Exception as e:  # noqa: BLE001 - report to every request in flight, keep serving
                    if self.group is not None:  # the ranks may no longer agree on the batch: stop them all
                        raise
                    self._fail_all(f"{type(e).__name__}: {e}")
        except BaseException as e:
            self.failure = f"{type(e).__name__}: {e}"
            self._fail_all(f"the engine stopped: {self.failure}")
            raise
        self._fail_all("server shutting down")

    def _plan(self) -> _Plan:
        """Rank 0's decisions for this turn."""
        plan = _Plan(cancel=[r.id for r in self._waiting + self._running if r.stream.cancelled and not r.cancelled],
                     evict=self._evicted, stop=self._stopping)
        self._evicted = []
        free = self.max_batch - len(self._waiting) - len(self._running)
        while self._inbox and free > 0:
            stream = self._inbox.popleft()
            req = stream.request
            if stream.cancelled:
                stream._put(FinishEvent("cancelled", len(req.tokens), 0, 0))
                continue
            if req.sampling.seed is None:
                req.sampling = req.sampling.updated(seed=int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)
            entry = (self.prefix_cache.lookup(_cache_key(self._image_rows(req), req.tokens), limit=len(req.tokens) - 1)
                     if self.prefix_cache is not None else None)
            plan.admit.append((next(self._ids), stream, entry.id if entry is not None else None))
            free -= 1
        return plan

    def _share(self, plan: Optional[_Plan]) -> _Plan:
        """Rank 0's plan on every rank (one broadcast; none without a group)."""
        if self.group is None:
            return plan
        text = None
        if plan is not None and not plan.empty():
            text = json.dumps({"admit": [(i, _request_to_json(s.request), e) for i, s, e in plan.admit],
                               "cancel": plan.cancel, "evict": plan.evict, "stop": plan.stop})
        text = comm.broadcast_text(text if self.leader else None, self.group)
        if self.leader:
            return plan
        if text is None:
            return _Plan()
        d = json.loads(text)
        admit = [(i, RequestStream(_request_from_json(r), None, silent=True), e) for i, r, e in d["admit"]]
        return _Plan(admit, d["cancel"], d["evict"], d["stop"])

    def _apply(self, plan: _Plan) -> None:
        if self.prefix_cache is not None and plan.evict and not self.leader:
            self.prefix_cache.remove(plan.evict)
        for row in self._waiting + self._running:
            if row.id in plan.cancel:
                row.cancelled = True
        for rid, stream, entry_id in plan.admit:
            try:
                self._waiting.append(self._start(rid, stream, entry_id))
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                if self.group is not None:  # the ranks may no longer agree on the batch: stop them all
                    raise
                stream._put(FinishEvent("error", len(stream.request.tokens), 0, 0, f"{type(e).__name__}: {e}"))

    def _start(self, rid: int, stream: RequestStream, entry_id: Optional[int]) -> _Row:
        """A row for ``stream``: its cache from prefix snapshot ``entry_id`` (or empty), and its snapshot points."""
        req = stream.request
        prompt = req.tokens
        rows = self._image_rows(req)
        row = _Row(rid, stream, RowSampler(req.sampling, prompt), rows, _cache_key(rows, prompt))
        if req.reasoning is not None:
            row.reasoning_left = req.reasoning.tokens
        if self._speculates(req):
            row.length = DraftLength(self.num_draft_tokens)
            row.drafter = self._drafter(row) if self.leader else None
        if entry_id is not None:
            entry = self.prefix_cache.get(entry_id)
            row.cache, row.done = cache_from_snapshot(entry.snapshot), entry.length
        else:
            row.cache = self.model.make_cache(**self.kv)
        stream.cached_tokens = row.done
        # the last boundary (where the last message ends and the generation prompt starts) is left to the prompt's
        # end: a continuation of the conversation repeats the generation prompt as its reply's first tokens, and a
        # snapshot a few tokens short of the end would cost a forward call of those few tokens on every request
        stops = {p: "message" for p in sorted(req.boundaries)[:-1]}
        if self.checkpoint_interval:
            for p in range(self.checkpoint_interval, len(prompt), self.checkpoint_interval):
                stops.setdefault(p, "interval")
        if req.system_end:
            stops[req.system_end] = "system"
        stops.setdefault(len(prompt) - 1, "message")
        row.stops = {p: k for p, k in stops.items() if row.done < p < len(prompt)}
        row.next_input = prompt[-1]
        return row

    def _speculates(self, req: GenerationRequest) -> bool:
        """Whether ``req`` speculates: it did not turn it off, and it has a prediction or the server a drafter (a
        draft model only for prompts without images: it has no vision tower)."""
        if not req.speculative:
            return False
        return bool(req.prediction) or self.draft == "lookup" or (self.draft is not None and not req.images)

    def _drafter(self, row: _Row):
        """A new row's drafter: prompt lookup (also over its prediction), else a ``DraftModel`` of the server's
        following the row's sampling and logits processors (its cache is the row's own)."""
        req = row.request
        if req.prediction or self.draft == "lookup":
            return PromptLookup(max_draft=self.num_draft_tokens, reference=req.prediction, reference_at=len(req.tokens))
        drafter = DraftModel(self.draft, **self.kv)
        drafter.prepare(self.model, _target(req.sampling), row.sampler.processors)
        return drafter

    def _snapshot(self, tokens: list[int], cache: HybridCache, row: int, kind: str, at: Optional[int] = None) -> None:
        if self.prefix_cache is not None:
            _, evicted = self.prefix_cache.insert(tokens, cache.snapshot(row, at), kind)
            self._evicted += evicted

    def _prefill(self) -> None:
        """Prefill waiting rows, up to ``prefill_chunk`` tokens in all; rows whose prompt is in join the batch."""
        budget = self.prefill_chunk
        for row in list(self._waiting):
            if row.cancelled:
                self._waiting.remove(row)
                self._finish(row, "cancelled")
                continue
            end = len(row.request.tokens) - 1
            while row.done < end and budget > 0:
                n = min(end - row.done, budget)
                points = sorted(p for p in row.stops if row.done < p <= row.done + n)
                row.cache.mark(points)
                self._forward(row, n)
                row.done += n
                budget -= n
                for p in points:  # each snapshot point the call passed, as the cache was there
                    self._snapshot(row.key[:p], row.cache, 0, row.stops[p], at=p)
            if row.done == end:
                self._waiting.remove(row)
                self._batch = row.cache if self._batch is None else merge_caches(
                    [self._batch, row.cache], keep_row_pages=self.prefix_cache is not None)  # reply snapshots share
                row.cache = None
                self._running.append(row)
            if budget <= 0:
                break

    def _forward(self, row: _Row, n: int) -> None:
        """Prefill the row's next ``n`` prompt tokens (from ``row.done``) into its cache. A chunk that overlaps
        image placeholders goes in as embeddings [1, n, hidden] with the features in place (it may begin or end
        inside an image; the features come from the encoder, which keeps them by digest)."""
        ids = mx.array(row.request.tokens[row.done : row.done + n])[None]  # [1, n]
        if row.rows is not None and row.done < row.rows.end:
            h = row.rows.embed(self.model.embed, ids, row.done, self.model.image_encoder.features)
            self.model(ids, cache=row.cache, input_embeddings=h)
        else:
            self.model(ids, cache=row.cache)
        mx.eval([c.state for c in row.cache])

    def _decode(self) -> None:
        """One decode step for every running row (or one speculative pass, when the batch can speculate); emits
        each row's tokens, retires the finished rows."""
        self._retire([r for r in self._running if r.cancelled], "cancelled")
        if not self._running:
            return
        if len(self._running) <= self.draft_max_batch and all(r.length is not None and not r.forced
                                                               for r in self._running):
            self._speculate(self._running[0])  # draft_max_batch is 1
        else:
            self._step()

    def _step(self) -> None:
        """The plain batched decode step: one token per running row."""
        inputs = mx.array([[r.next_input] for r in self._running])
        logits = self.model(inputs, cache=self._batch)[:, -1]
        tokens, lps = self._sample(logits)
        forced = [r.forced[0] if r.forced else -1 for r in self._running]
        if max(forced) >= 0:
            given = mx.array(forced, dtype=mx.int32)
            tokens = mx.where(given >= 0, given, tokens)
        if self.group is not None:  # rank 0's draws everywhere; the others add zeros that still depend on the
            # step's logits, so every rank runs the forward's collectives before this one, in the same order
            tokens = comm.all_sum(tokens if self.leader else tokens * 0, self.group)
        mx.eval(tokens)
        done = {"stop": [], "length": []}
        for row, token, lp in zip(self._running, tokens.tolist(), lps):
            reason = self._emit(row, token, lp)
            if reason is not None:
                done[reason].append(row)
        for reason, rows in done.items():
            self._retire(rows, reason)

    def _speculate(self, row: _Row) -> None:
        """One speculative pass for the batch's only row: rank 0's drafts verified in one forward pass, rank 0's
        accepted tokens emitted up to the first stop token, the cache rolled back to what was emitted."""
        drafts, q = self._drafts(row)
        target, key = _target(row.sampler.params), None
        if target is not None:
            row.sampler.key, key = mx.random.split(row.sampler.key)
        tokens, n, logprobs = verify_step(self.model, self._batch, row.sampler.history, drafts, draft_probs=q,
                                          processors=row.sampler.processors, target=target, key=key)
        n, *tokens = self._share_ints([n, *tokens])
        stop = next((i for i, t in enumerate(tokens) if t in row.request.stop_token_ids), len(tokens) - 1)
        kept = min(n, stop)  # drafts emitted (a stop token ends the run: what follows it is dropped)
        rollback(self.model, self._batch, row.next_input, drafts, kept)
        row.length.observe(n, len(drafts))
        if row.drafter is not None:
            row.drafter.observe(n, len(drafts))
        row.drafted, row.accepted = row.drafted + len(drafts), row.accepted + kept
        self._passes += bool(drafts)
        self._drafted, self._accepted = self._drafted + len(drafts), self._accepted + kept
        for i, token in enumerate(tokens[: kept + 1]):
            reason = self._emit(row, token, logprobs[i])
            if reason is not None:
                self._retire([row], reason)
                return

    def _drafts(self, row: _Row) -> tuple[list[int], Optional[mx.array]]:
        """Rank 0's drafts for ``row``'s next pass on every rank (none while its length is 0, which every rank
        knows), and their q ([k, vocab] on rank 0 for a sampling draft model, else None)."""
        k = row.draft_limit()
        if k == 0:
            return [], None
        drafts, q = [], None
        if self.leader:
            drafts, q = propose_drafts(row.drafter, row.request.tokens + row.generated, k, self.model.args.vocab_size)
        return self._share_ints(drafts), q

    def _share_ints(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (as they are without a group)."""
        if self.group is None:
            return values
        return comm.broadcast_ids(values, self.group)

    def _emit(self, row: _Row, token: int, lp: mx.array) -> Optional[str]:
        """Append ``token`` (log-probabilities ``lp`` [vocab]) to ``row``'s reply and send its event; returns why
        the row is done ("stop", "length") or None."""
        row.sampler.record(token)
        row.follow_budget(token)
        row.generated.append(token)
        row.next_input = token
        if self.leader:
            row.stream._put(self._token_event(row, token, lp))
        if token in row.request.stop_token_ids:
            return "stop"
        if len(row.generated) >= row.request.max_tokens:
            return "length"
        return None

    def _sample(self, logits: mx.array) -> tuple[mx.array, list[mx.array]]:
        """(token ids [B] int32, each row's log-probabilities [vocab]) from the step's logits [B, vocab] (lazy).
        Rows that are plain greedy (temp 0, no processors) share one batched log-softmax and argmax."""
        plain = [r.sampler.params.temp == 0 and not r.sampler.processors for r in self._running]
        batch_lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(batch_lp, axis=-1).astype(mx.int32)
        lps = [batch_lp[i] for i in range(len(plain))]
        if not all(plain):
            drawn = []
            for i, row in enumerate(self._running):
                if plain[i]:
                    drawn.append(tokens[i : i + 1])
                else:
                    lp = row.sampler.logprobs(logits[i : i + 1])
                    drawn.append(row.sampler.draw(lp).astype(mx.int32))
                    lps[i] = lp[0]
            tokens = mx.concatenate(drawn)
        return tokens, lps

    def _token_event(self, row: _Row, token: int, lp: mx.array) -> TokenEvent:
        """lp: the row's log-probabilities [vocab]."""
        k = row.request.top_logprobs
        if k is None:
            return TokenEvent(token)
        top = None
        if k > 0:
            ids = top_logprobs(lp, k)
            top = list(zip(ids.tolist(), lp[ids].tolist()))
        return TokenEvent(token, lp[token].item(), top)

    def _retire(self, rows: list[_Row], reason: str) -> None:
        """Take ``rows`` out of the batch; a finished row's cache (prompt + reply but its last token) is kept as a
        "reply" snapshot."""
        if not rows:
            return
        if reason != "cancelled":
            for r in rows:
                self._snapshot(r.key + r.generated[:-1], self._batch, self._running.index(r), "reply")
        keep = [i for i, r in enumerate(self._running) if r not in rows]
        if keep:
            self._batch.filter(keep)
        else:
            self._batch = None
        self._running = [self._running[i] for i in keep]
        for r in rows:
            self._finish(r, reason)

    def _finish(self, row: _Row, reason: str, error: Optional[str] = None) -> None:
        req = row.request
        row.stream._put(FinishEvent(reason, len(req.tokens), row.stream.cached_tokens, len(row.generated), error,
                                    row.drafted, row.accepted))
        self._finished += 1
        self._durations.append(time.perf_counter() - row.stream.submitted)

    def _fail_all(self, error: str) -> None:
        rows = self._waiting + self._running
        self._waiting, self._running, self._batch = [], [], None
        for row in rows:
            self._finish(row, "error", error)
        while self._inbox:
            stream = self._inbox.popleft()
            stream._put(FinishEvent("error", len(stream.request.tokens), 0, 0, error))
