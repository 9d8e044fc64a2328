"""The cost model of README "Planning a cluster": which rank holds what (``plan_pipeline``, ``plan_tensor``), its
memory against its host's, and the predicted seconds per token from bytes read, FLOPs and the links.

A rank's share is (layers held, non-layer parts held, ``TensorShare`` or None); the fraction of each parameter it
holds is its split field's count over the config's (whole when not split). Hosts are ``Host`` (memory, bandwidth,
FLOP/s, GPU working set), links ``Link`` (bandwidth, latency per message).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..config import KimiConfig
from ..ops.memory import FILL, MIB, default_working_set, wired_limit_mib
from .accounting import GB, GIB, Accounting, Param, cache_bytes
from .splits import SPLIT_SIZES, TensorShare, pipeline_ranges, tensor_shares


# K3's vision tower and projector: held by rank 0 (which encodes images and shares the features), counted in its
# memory, never read per token (it runs once per new image).
TOWER = frozenset({"vision"})


def _fraction(cfg: KimiConfig, p: Param, share: Optional[TensorShare]) -> float:
    """The fraction of ``p`` a rank holding ``share`` keeps: its split field's count over the config's, else all of
    it, or none where it belongs to a block the rank holds none of (``Param.idle``: e.g. a KDA block without heads;
    of an MLA block such a rank keeps only what fills the whole latent cache)."""
    if share is None:
        return 1.0
    if p.split is None:
        return 0.0 if p.idle is not None and not getattr(share, p.idle) else 1.0
    return len(getattr(share, p.split)) / SPLIT_SIZES[p.split](cfg)


def _gathered(cfg: KimiConfig, p: Param) -> bool:
    """The embedding, when only gathered from (a tied embedding is also the head, read whole)."""
    return p.part == "embed" and not cfg.tie_word_embeddings


def _read_fraction(cfg: KimiConfig, p: Param) -> float:
    """Fraction of a parameter one decoded token reads: top-k of E experts, one row of the embedding, else all."""
    if p.expert:
        return cfg.num_experts_per_token / cfg.num_experts
    return 1 / cfg.vocab_size if _gathered(cfg, p) else 1.0


def _held(p: Param, layers: range, parts: frozenset) -> bool:
    return p.layer in layers if p.part == "layer" else p.part in parts


def weight_bytes(acct: Accounting, layers: range, parts: frozenset, share: Optional[TensorShare] = None) -> int:
    """Bytes of the parameters a rank holds: its ``layers``, the non-layer ``parts`` ("embed", "norm", "head",
    "output_attn_res", "vision") and, under tensor parallelism, its ``share`` of every split parameter."""
    return round(sum(acct.nbytes[p.name] * _fraction(acct.cfg, p, share)
                     for p in acct.params if _held(p, layers, parts)))


def decode_bytes(acct: Accounting, context: int, layers: range, parts: frozenset,
                 share: Optional[TensorShare] = None, kv: Optional[dict] = None) -> float:
    """Bytes one decoded token reads on a rank at ``context``: the weights it uses (every expert share at top-k/E,
    one embedding row) plus its cache (MLA latent read once; KDA state read and written). ``kv``: ``cache_bytes``'s
    ``kv_bits`` / ``kv_group_size``."""
    cfg = acct.cfg
    weights = sum(acct.nbytes[p.name] * _fraction(cfg, p, share) * _read_fraction(cfg, p)
                  for p in acct.params if _held(p, layers, parts))
    a = acct.act_bytes
    kda_state = cache_bytes(cfg, 0, [i for i in layers if cfg.is_kda_layer(i)], share, act_bytes=a)
    return weights + cache_bytes(cfg, context, layers, share, act_bytes=a, **(kv or {})) + kda_state


def token_flops(acct: Accounting, context: float, layers: range, parts: frozenset,
                share: Optional[TensorShare] = None, prefill_chunk: Optional[int] = None) -> float:
    """FLOPs of one token on a rank: 2 per multiply-add of every weight it uses (experts at top-k/E; the embedding
    is a gather), plus attention over ``context`` keys per MLA head (decode, absorbed: 2 x (2 x kv_lora_rank +
    qk_rope) per key; prefill, expanded: 2 x (qk_nope + qk_rope + v) per key at the average ``context``, and the
    latent -> per-head k/v expansion of every cached key once per chunk of ``prefill_chunk`` tokens), plus ~8 x D^2
    per KDA head (the state update and read)."""
    cfg = acct.cfg
    matmul = sum(2 * p.numel * _fraction(cfg, p, share) * _read_fraction(cfg, p)
                 for p in acct.params if _held(p, layers, parts) and not _gathered(cfg, p))
    mla_heads = cfg.num_attention_heads if share is None else len(share.mla_heads)
    kda_heads = cfg.kda_num_heads if share is None else len(share.kda_heads)
    R, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if prefill_chunk is None:
        mla = 2 * mla_heads * (2 * R + rope) * context
    else:
        mla = 2 * mla_heads * ((nope + rope + v) * context + R * (nope + v) * context / prefill_chunk)
    kda = 8 * kda_heads * cfg.kda_head_dim**2
    return matmul + sum(kda if cfg.is_kda_layer(i) else mla for i in layers)


def chunk_bytes(acct: Accounting, chunk: int, layers: range, parts: frozenset,
                share: Optional[TensorShare] = None) -> float:
    """Weight bytes one prefill chunk of ``chunk`` tokens reads on a rank: every expert at the chance that one of the
    chunk's tokens routes to it, 1 - (1 - k/E)^chunk; ``chunk`` embedding rows; everything else once."""
    cfg = acct.cfg

    def read(p: Param) -> float:
        if p.expert:
            return 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** chunk
        return min(1.0, chunk / cfg.vocab_size) if _gathered(cfg, p) else 1.0

    return sum(acct.nbytes[p.name] * _fraction(cfg, p, share) * read(p)
               for p in acct.params if _held(p, layers, parts))


def attn_res_blocks(cfg: KimiConfig, layer: int) -> int:
    """Completed K3 AttnRes block snapshots before decoder layer ``layer`` (0 without AttnRes)."""
    if cfg.attn_res_block_size is None:
        return 0
    return -(-layer // cfg.attn_res_block_size)


# ------------------------------------------------------------------------------------------------ plans

@dataclass(frozen=True)
class Host:
    """One Mac: ``memory_gib`` of unified memory (GiB = 2**30 bytes), memory ``bandwidth_gbs`` (GB/s = 1e9 bytes/s)
    and ``tflops`` (1e12 FLOP/s) when known; ``wired_limit_gib``: its GPU working set when known (a raised
    ``iogpu.wired_limit_mb`` / 1024, or what the Mac reports), None: macOS's default for its memory."""

    memory_gib: float
    bandwidth_gbs: Optional[float] = None
    tflops: Optional[float] = None
    wired_limit_gib: Optional[float] = None

    @property
    def working_set(self) -> int:
        """Bytes the GPU may keep wired: ``wired_limit_gib``, else ``ops.memory.default_working_set``."""
        if self.wired_limit_gib is not None:
            return int(self.wired_limit_gib * GIB)
        return default_working_set(int(self.memory_gib * GIB))


ULTRA_MIN_GIB, ULTRA_BANDWIDTH_GBS = 192, 819.2


def default_bandwidth(memory_gib: float) -> Optional[float]:
    """Memory bandwidth in GB/s where the memory size tells the chip: every Mac of 192 GiB or more is an M2 Ultra or
    M3 Ultra, both 819.2 GB/s (Apple's specifications). Below that it does not (64 GiB: M4 Pro 273 GB/s or M4 Max
    546 GB/s; 128 GiB: M4 Max or M3 Ultra): None."""
    return ULTRA_BANDWIDTH_GBS if memory_gib >= ULTRA_MIN_GIB else None


@dataclass(frozen=True)
class Link:
    """The links between hosts: ``bandwidth_gbs`` (GB/s) and ``latency_us`` per message (µs)."""

    bandwidth_gbs: float
    latency_us: float

    def send(self, nbytes: float, messages: int = 1) -> float:
        """Seconds for ``messages`` point-to-point messages carrying ``nbytes`` in all."""
        return messages * self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbs * 1e9)

    def all_sum(self, nbytes: float, n: int, times: int = 1) -> float:
        """Seconds for ``times`` ring all_sums over ``n`` ranks summing ``nbytes`` in all: each takes 2(n-1) steps,
        and a rank sends 2(n-1)/n of the bytes."""
        return 0.0 if n < 2 else self.send(2 * (n - 1) / n * nbytes, times * 2 * (n - 1))


# RDMA over Thunderbolt 5 (backend jaccl), as reported in ../shared/spec/distributed_and_server.md §1.7 (8 GB/s,
# 25.5 µs); ring over TCP has about 10x the latency (MLX's docs).
JACCL_TB5 = Link(8.0, 25.5)


@dataclass(frozen=True)
class RankPlan:
    """What one rank holds and needs. Bytes are bytes; ``usable`` = host memory - reserve (the most its GPU can be
    given: the RAM fit); ``wired_ok``: the need takes at most ``FILL`` of the host's GPU working set (the rest is for
    activations), so it runs without raising the host's wired limit."""

    rank: int
    host: Host
    layers: range
    parts: frozenset
    share: Optional[TensorShare]
    weights: int
    cache: int
    usable: int

    @property
    def need(self) -> int:
        return self.weights + self.cache

    @property
    def free(self) -> int:
        """Usable bytes left (negative: the shortfall)."""
        return self.usable - self.need

    @property
    def wired_ok(self) -> bool:
        return self.need <= FILL * self.host.working_set


@dataclass(frozen=True)
class Speed:
    """Predicted seconds: ``compute`` per stage (max of bytes / bandwidth and FLOPs / FLOP/s, see README), ``head``
    (the replicated head, in parallel on every rank; pipeline only), ``links`` (messages and collectives)."""

    tokens: int
    compute: tuple[float, ...]
    head: float
    links: float
    serial: bool  # pipeline: stages run one after another; tensor: in parallel

    @property
    def seconds(self) -> float:
        return (sum(self.compute) if self.serial else max(self.compute)) + self.head + self.links

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Plan:
    """A split of the model over hosts, its memory per rank and predicted speed (None where a host's bandwidth,
    or for prefill its FLOP/s, is not known)."""

    mode: str  # "pipeline" or "tensor"
    acct: Accounting
    context: int
    reserve_gib: float
    link: Link
    ranks: tuple[RankPlan, ...]
    decode: Optional[Speed]
    prefill: Optional[Speed]
    link_bytes: float  # bytes sent per decoded token by the busiest rank
    kv_bits: Optional[int] = None  # latent cache layout (``cache_bytes``)
    kv_group_size: int = 64
    split_by_working_set: bool = False  # pipeline: layers in proportion to the hosts' working sets (load's default)

    @property
    def fits(self) -> bool:
        """Every rank fits its host's memory - reserve (``wired_limits`` says whether a host's limit must be raised
        first)."""
        return all(r.free >= 0 for r in self.ranks)

    def wired_limits(self) -> dict[int, int]:
        """For a plan that fits: rank -> the ``iogpu.wired_limit_mb`` (MiB) to raise its host to, so that the rank's
        weights and cache take at most ``FILL`` of its GPU working set; empty when every rank already does. Under the
        default pipeline split (by working set, as ``load`` splits) every host is raised by the same factor, so that
        ``load`` still makes the planned split; otherwise only the ranks short of it. Never above a host's usable
        memory (memory - reserve): ``tight`` names the ranks still short at the limits."""
        if all(r.wired_ok for r in self.ranks):
            return {}
        if self.split_by_working_set:
            needed = max(r.need / (FILL * r.host.working_set) for r in self.ranks)
            factor = min(needed, min(r.usable / r.host.working_set for r in self.ranks))
            wanted = {r.rank: math.ceil(factor * r.host.working_set / MIB) for r in self.ranks}
        else:
            wanted = {r.rank: wired_limit_mib(r.need) for r in self.ranks if not r.wired_ok}
        limits = {rank: min(mib, self.ranks[rank].usable // MIB) for rank, mib in wanted.items()}
        return {rank: mib for rank, mib in limits.items() if mib * MIB > self.ranks[rank].host.working_set}

    def tight(self, limits: dict[int, int]) -> list[int]:
        """Ranks whose need still takes more than ``FILL`` of their host's working set with ``limits`` applied."""
        return [r.rank for r in self.ranks
                if r.need > FILL * (limits[r.rank] * MIB if r.rank in limits else r.host.working_set)]

    def shortfall(self) -> list[str]:
        """One line per rank that does not fit, and the whole cluster's shortfall; empty when it fits."""
        lines = [f"rank {r.rank} needs {r.need / GB:.1f} GB (weights {r.weights / GB:.1f} + cache {r.cache / GB:.1f})"
                 f" but has {r.usable / GB:.1f} GB usable ({r.host.memory_gib:g} GiB - {self.reserve_gib:g} GiB "
                 f"reserve): short by {-r.free / GB:.1f} GB" for r in self.ranks if r.free < 0]
        if lines:
            need, usable = sum(r.need for r in self.ranks), sum(r.usable for r in self.ranks)
            verdict = (f"short by {(need - usable) / GB:.1f} GB in all" if need > usable
                       else "enough in all: another split may fit")
            lines.append(f"the ranks need {need / GB:.1f} GB together and have {usable / GB:.1f} GB usable: {verdict}")
        return lines


def _usable(host: Host, reserve_gib: float) -> int:
    return int((host.memory_gib - reserve_gib) * GIB)


def _check_hosts(hosts: Sequence[Host], reserve_gib: float) -> None:
    if not hosts:
        raise ValueError("no hosts: expected the memory of at least one host")
    for i, h in enumerate(hosts):
        if not h.memory_gib > reserve_gib:
            raise ValueError(f"host {i}: memory {h.memory_gib:g} GiB; expected more than the {reserve_gib:g} GiB "
                             f"reserve")
        if h.wired_limit_gib is not None and not 0 < h.wired_limit_gib <= h.memory_gib:
            raise ValueError(f"host {i}: wired limit {h.wired_limit_gib:g} GiB; expected a positive number no larger "
                             f"than its {h.memory_gib:g} GiB of memory")
        for what, v in (("bandwidth", h.bandwidth_gbs), ("tflops", h.tflops)):
            if v is not None and not v > 0:
                raise ValueError(f"host {i}: {what} {v:g}; expected a positive number")


def plan_pipeline(acct: Accounting, hosts: Sequence[Host], link: Link = JACCL_TB5,
                  split: Union[None, str, Sequence[int]] = None, context: int = 32768, reserve_gib: float = 8.0,
                  prefill_chunk: int = 2048, kv_bits: Optional[int] = None, kv_group_size: int = 64) -> Plan:
    """Contiguous layer ranges per host (``pipeline_ranges``: by default proportional to each host's GPU working
    set, as ``load(parallel="pipeline")`` splits by each Mac's), the embedding on rank 0, the final norm and
    head on every rank (the final hidden state is shared, not the logits), K3's ``output_attn_res`` on the last.
    ``kv_bits`` / ``kv_group_size``: the latent cache's layout (``cache_bytes``)."""
    _check_hosts(hosts, reserve_gib)
    cfg, n = acct.cfg, len(hosts)
    usable = [_usable(h, reserve_gib) for h in hosts]
    ranges = pipeline_ranges(acct.layer_bytes(), [h.working_set for h in hosts], split)
    head = _head_parts(cfg)
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
    ranks = []
    for r, (host, layers) in enumerate(zip(hosts, ranges)):
        parts = head | ({"embed"} if r == 0 else set()) | ({"output_attn_res"} if r == n - 1 else set())
        held = parts | (TOWER if r == 0 else set())
        ranks.append(RankPlan(r, host, layers, frozenset(parts), None, weight_bytes(acct, layers, held),
                              cache_bytes(cfg, context, layers, act_bytes=acct.act_bytes, **kv), usable[r]))
    message = [(attn_res_blocks(cfg, rp.layers.stop) + 1) * cfg.hidden_size * acct.act_bytes for rp in ranks[:-1]]
    final = cfg.hidden_size * acct.act_bytes
    return Plan("pipeline", acct, context, reserve_gib, link, tuple(ranks),
                _pipeline_decode(acct, ranks, link, context, head, message, final, kv),
                _pipeline_prefill(acct, ranks, link, context, head, message, final, prefill_chunk),
                max(message + [0]) + 2 * (n - 1) / n * final, kv_bits, kv_group_size, split is None)


def _head_parts(cfg: KimiConfig) -> frozenset:
    """The final norm and the head (the embedding, when tied): replicated on every rank."""
    return frozenset({"embed" if cfg.tie_word_embeddings else "head", "norm"})


def _stage(host: Host, nbytes: float, flops: float) -> float:
    """Seconds of one rank's work: the slower of reading ``nbytes`` and computing ``flops`` (the latter only when
    the host's FLOP/s is known)."""
    t = nbytes / (host.bandwidth_gbs * 1e9)
    if host.tflops is not None:
        t = max(t, flops / (host.tflops * 1e12))
    return t


def _pipeline_decode(acct, ranks, link, context, head, message, final, kv) -> Optional[Speed]:
    if any(rp.host.bandwidth_gbs is None for rp in ranks):
        return None
    body = [rp.parts - head for rp in ranks]
    compute = tuple(_stage(rp.host, decode_bytes(acct, context, rp.layers, b, kv=kv),
                           token_flops(acct, context, rp.layers, b)) for rp, b in zip(ranks, body))
    head_t = max(_stage(rp.host, decode_bytes(acct, context, range(0), head),
                        token_flops(acct, context, range(0), head)) for rp in ranks)
    links = sum(link.send(m) for m in message) + link.all_sum(final, len(ranks))
    return Speed(1, compute, head_t, links, serial=True)


def _pipeline_prefill(acct, ranks, link, context, head, message, final, chunk) -> Optional[Speed]:
    if any(rp.host.bandwidth_gbs is None or rp.host.tflops is None for rp in ranks):
        return None
    chunks = -(-context // chunk)
    body = [rp.parts - head for rp in ranks]

    def stage(rp, parts, layers):
        flops = context * token_flops(acct, context / 2, layers, parts, prefill_chunk=chunk)
        return _stage(rp.host, chunks * chunk_bytes(acct, chunk, layers, parts), flops)

    compute = tuple(stage(rp, b, rp.layers) for rp, b in zip(ranks, body))
    rows = min(chunk, context)
    links = sum(link.send(m * context, chunks) for m in message) + link.all_sum(final * rows, len(ranks))
    return Speed(context, compute, _prefill_head(acct, ranks, head, rows), links, serial=True)


def _prefill_head(acct: Accounting, ranks: Sequence[RankPlan], head: frozenset, rows: int) -> float:
    """Seconds of the replicated norm + head over the last chunk's ``rows`` tokens, in parallel on every rank (MLX
    evaluates only the caches of earlier chunks, never their logits)."""
    return max(_stage(rp.host, chunk_bytes(acct, rows, range(0), head),
                      rows * token_flops(acct, 0, range(0), head)) for rp in ranks)


def plan_tensor(acct: Accounting, hosts: Sequence[Host], link: Link = JACCL_TB5, context: int = 32768,
                reserve_gib: float = 8.0, prefill_chunk: int = 2048, kv_bits: Optional[int] = None,
                kv_group_size: int = 64) -> Plan:
    """Tensor + expert parallelism: every rank holds every layer's ``tensor_shares`` part (KDA and MLA heads, routed
    experts whole, MLP widths on multiples of the quantization group) and the replicated rest (embedding, head,
    norms, routers, MLA ``kv_a_proj`` + norm, q-LoRA ``q_a_proj``, KDA ``f_a`` / ``g_a`` and ``o_norm``, latent-MoE
    down/up projections and norm). Each layer's attention and MLP outputs are combined with one all_sum each.
    ValueError where a rank's heads would cut an output projection inside a quantization group or GGML block (as
    ``load(parallel="tensor")`` would)."""
    _check_hosts(hosts, reserve_gib)
    cfg, n = acct.cfg, len(hosts)
    layers = range(cfg.num_hidden_layers)
    parts = frozenset({"embed", "norm", "head", "output_attn_res"})
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size)
    shares = tensor_shares(cfg, n, acct.split_unit())
    _check_head_cuts(acct, shares)
    ranks = tuple(
        RankPlan(r, host, layers, parts, share, weight_bytes(acct, layers, parts | (TOWER if r == 0 else set()), share),
                 cache_bytes(cfg, context, layers, share, act_bytes=acct.act_bytes, **kv), _usable(host, reserve_gib))
        for r, (host, share) in enumerate(zip(hosts, shares))
    )
    hidden = cfg.hidden_size * acct.act_bytes
    all_sums = 2 * cfg.num_hidden_layers
    decode = prefill = None
    if all(h.bandwidth_gbs is not None for h in hosts):
        compute = tuple(_stage(rp.host, decode_bytes(acct, context, layers, parts, rp.share, kv),
                               token_flops(acct, context, layers, parts, rp.share)) for rp in ranks)
        decode = Speed(1, compute, 0.0, link.all_sum(all_sums * hidden, n, all_sums), serial=False)
    if all(h.bandwidth_gbs is not None and h.tflops is not None for h in hosts):
        chunks, body = -(-context // prefill_chunk), parts - _head_parts(cfg)
        compute = tuple(_stage(rp.host, chunks * chunk_bytes(acct, prefill_chunk, layers, body, rp.share),
                               context * token_flops(acct, context / 2, layers, body, rp.share, prefill_chunk))
                        for rp in ranks)
        head = _prefill_head(acct, ranks, _head_parts(cfg), min(prefill_chunk, context))
        prefill = Speed(context, compute, head, link.all_sum(all_sums * hidden * context, n, chunks * all_sums),
                        serial=False)
    per_rank = all_sums * 2 * (n - 1) / n * hidden
    return Plan("tensor", acct, context, reserve_gib, link, ranks, decode, prefill, per_rank, kv_bits, kv_group_size)


def _check_head_cuts(acct: Accounting, shares: Sequence[TensorShare]) -> None:
    """Each rank's heads cut the attention output projections (``o_proj``: [hidden, heads x head width]) by column;
    the cuts must fall on whole quantization groups / GGML blocks (``acct.group``), else ValueError naming the
    parameter, its layout, the rank and the columns."""
    for p in acct.params:
        unit = acct.group.get(p.name, 1)
        if p.split not in ("kda_heads", "mla_heads") or not p.columns or unit == 1:
            continue
        width = p.shape[-1] // SPLIT_SIZES[p.split](acct.cfg)
        for r, share in enumerate(shares):
            heads = getattr(share, p.split)
            if heads.start * width % unit or heads.stop * width % unit:
                raise ValueError(
                    f"{p.name} ({acct.layout[p.name]}): rank {r}'s heads {heads.start}-{heads.stop - 1} are columns "
                    f"{heads.start * width}:{heads.stop * width}, which do not fall on its {unit}-column groups / "
                    f"blocks; tensor parallelism over {len(shares)} ranks cannot cut it (another rank count, "
                    "pipeline, or a layout with smaller groups can)")
