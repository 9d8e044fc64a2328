"""Speculative decoding on the hybrid cache (issue 24): drafts verified in one pass, the rejected suffix rolled back.

One job per module, on floor 1 beside ``generate`` (it imports ``cache`` and ``sampling``; ``generate`` imports it):

- ``drafts``: the ``Drafter`` interface (``propose(history, k)`` -> draft ids, ``observe(accepted, proposed)``;
  optional ``prepare(target, sampling, processors)`` and ``draft_probs``, the drafts' q), ``PromptLookup`` (n-gram
  match over prompt + generated text; ``ngram_sizes``, ``max_draft``, ``window``) and ``make_drafter``.
- ``draft_model``: ``DraftModel(model)``, a Kimi model (Kimi Linear or K3, any format ``load`` reads; sharing the
  target's tokenizer) with its own ``HybridCache`` (latent quantization as the target's: ``kv_bits``,
  ``kv_group_size``, ``quantized_kv_start``). ``propose`` brings its cache to the history (feeds what it has not seen
  in one pass; back to the common prefix first when the history is not an extension of what it holds: ``trim`` to
  the latest checkpoint there, then re-feed), then drafts k tokens, one decode step each, a checkpoint before each
  step: the next history's common prefix is one of those checkpoints, so the rejected drafts are dropped by a
  restore, with nothing re-fed (the target's ``rollback`` re-feeds because its pass fed 1 + k tokens at once; the
  draft's steps feed one token each, so a checkpoint per step costs no copy). Greedy: argmax drafts; sampled: drawn
  from its own distribution under the target's options, q handed to ``accept_sampled``. It applies the target's
  logits processors too (better acceptance; exact either way). ``check_draft_vocab`` refuses another vocabulary
  size.
- ``verify``: ``verify_pass`` (checkpoint, then ``[last, d_1 .. d_k]`` in one forward pass) and ``rollback``
  (trim back to the checkpoint through ``HybridCache.trim`` and re-feed the accepted tokens; release the checkpoint).
  Why re-feed and not per-step KDA states: its docstring, with the measurements below.
- ``accept``: greedy acceptance (argmax match) and the speculative-sampling rule (min(1, p/q), residual max(p - q, 0);
  one-hot q for model-free drafts); ``TargetSampling`` gives the target's distribution for mlx-lm's temp / top_p /
  min_p / top_k.
- ``adaptive``: ``DraftLength``, the next draft length from the recent acceptance, and the off switch.
- ``loop``: ``speculative_steps`` (batch of one): prefill, then draft / verify / accept / roll back / adapt, yielding
  ``(token, logprobs, Speculation)``; it calls a drafter's ``prepare`` first and passes its ``draft_probs`` as q
  (``propose_drafts``). Its pass, ``verify_step`` (verify + processors + acceptance, before the rollback), is also
  the server engine's speculative turn (``kimi_mlx.server.scheduler``).

Surface so far: ``stream_generate(..., draft="lookup" | a loaded Kimi model | a Drafter, num_draft_tokens=k)``
(``draft_model=``: mlx-lm's name for ``draft=<model>``, an error with ``draft=``; and ``generate``, which passes
keywords on); ``loading.load_draft(path, tokenizer, **load options)`` loads a draft model like ``load`` and refuses
one whose tokenizer's vocabulary differs (naming the path and the first differing ids); every response is a
``SpeculativeResponse`` (``generate.py``: a ``GenerationResponse`` with ``drafted_tokens`` / ``accepted_tokens``,
``from_draft`` set on accepted drafts; 0 without ``draft=``). Logits
processors (penalties, ``logit_bias``) are applied per verified position on the history plus the drafts before it.
Refused: a custom ``sampler=`` (its distribution is unknown), ``images=`` (the verify pass and the drafters take
token ids; a draft model's vision tower is dropped by ``load_draft`` and never used), a draft model of another
vocabulary size.

``ChatSession(..., draft=, num_draft_tokens=)`` speculates every turn: its drafter is asked with the whole
conversation (``InContext``: the cache's tokens, then the turn's), and its cache and checkpoints end each turn as
without speculation (the verify pass's checkpoint is transient: ``HybridCache.checkpoint(transient=True)``, so it
never releases one of the caller's). ``kimi-mlx generate|chat|bench --draft lookup|PATH --num-draft-tokens K``
(``cli/flags.py``). Distributed (``parallel=``): every rank runs the loop in lockstep, and ``speculative_steps``'s
``rank0`` (a parallel model's ``rank0_ids``: a broadcast from rank 0) makes every rank verify rank 0's drafts and
keep rank 0's outcome, so drafts, accepted counts, tokens and draft lengths are the same on every rank even where
drafters (a draft model on ranks of different hardware) or draws could differ.

Guarantees and their tests (tests/test_speculative.py; planted bugs in tests/planted_bugs.py):

- greedy tokens equal plain decoding (mlx-lm's ``generate_step``) on the Kimi Linear and K3 fixtures, float and 8-bit
  latent, 22 prompts x 64/128 tokens with prompt lookup, and with drafts built from the target's own continuation
  so that every draft is accepted / every draft is rejected;
- after each rollback the cache is bitwise the same segments fed to a fresh cache (both fixtures, float and 8-bit),
  and within 1e-5 (relative to the array's scale above 1) of a fresh one-pass prefill of the same tokens for Kimi
  Linear float / 8-bit and K3 float. K3 with an 8-bit latent is not compared with a one-pass prefill: incremental
  feeding (plain decoding too) flips a few 8-bit codes against it (measured: 2 codes, then ~1e-3 in later KDA conv
  states), a property of quantizing per segment, not of the rollback;
- sampled: a chi-square test over 20000 seeded draws on fixed logits (first token ~ p_0; second, after an accepted
  first draft, ~ p_1), one-hot drafts and drafts drawn from a q; false-failure rate 1e-4 per test (2e-4 per case);
  seeded runs reproduce.

Draft models (tests/test_speculative_draft_model.py):

- greedy tokens equal plain decoding on both fixtures, float and 8-bit latent, with the target as its own draft (every
  draft accepted), other random weights of the same shapes (at most 10% accepted) and the target's weights plus 2%
  noise (some accepted); with penalties and a logit bias through ``stream_generate(draft=load_draft(...))`` (the
  target as its own draft: every draft accepted, since the draft applies the processors too);
- after each proposal the draft's cache is bitwise the same segments fed to a fresh cache and within 1e-5 of a
  one-pass prefill of the ids it holds (not K3 8-bit, as above), over histories that take drafts, skip ahead and
  diverge; after a verify-like outcome only the new tokens are fed (the rejected drafts are not re-fed); its drafts
  equal a fresh draft model's on the same history;
- sampled: ``draft_probs`` equals numpy's distribution of the draft model's fresh logits under the target's options;
  one verify pass of 2 drafts from a perturbed draft model, 400 seeded draws: first token ~ p_0 and second (after the
  likeliest accepted first draft) ~ p_1, chi-square at 1e-4 each; the target as its own sampled draft has >= 95% of
  its drafts accepted (a one-hot q would accept almost none); seeded runs reproduce.

Hidden-state drafters (K3's DSpark; mlx-vlm's ``speculative/drafters/dspark``) are not built: they read the target's
hidden states at chosen layers, and the text model's forward (``KimiLinearModel.__call__``, the one loop of every
text model and pipeline stage) hands out only the final normed state. What it would take: (1) that loop returns the
residual stream after the chosen layers when asked (a ``capture`` argument: a branch in the model file; for K3 the
AttnRes stream's state in the form the drafter was trained on; on a pipeline the captured states sent to the rank
that drafts); (2) ``verify_pass`` returns those rows with the logits and ``rollback``'s re-feed captures too, so the
drafter gets the states of exactly the accepted positions; (3) a drafter taking them (``propose(history, k)`` plus
the latest captured states; DSpark drafts a block in one pass of its own small model with its own cache, then a
low-rank token-transition correction per position; mlx-vlm runs it greedy only); (4) a loader for its checkpoint
(target layer ids, block size, mask token id) refusing a drafter made for another target (hidden size, layer count,
vocabulary).

Measurements (bench/bench_speculative.py; Linux CPU, float32, 2 shared cores: plain decoding itself varies by
+-15% run to run). Demo model, 256-token prompt, medians of 5, in multiples of one decode step (1.5 ms):

    k                         1     2     4     8     16
    verify pass (1 + k)     1.8x  2.0x  3.3x  4.4x  6.3x
    re-feed n = k // 2      0.8x  1.7x  2.1x  3.3x  4.4x   (the chosen rollback's extra cost after a rejection;
                                                           the per-step option's pass costs >= the verify row)

    decode tok/s vs plain, 512 tokens:  accepted  100%    50%    0%    0% with the adaptive length
                                  k=4:           1.34x  0.71x  0.33x  1.03x
                                  k=8:           1.62x  0.61x  0.26x  0.88x  (0.84-1.04 over runs: noise-bound)

Bench model of bench_vs_mlx_lm.py (hidden 768, 12 layers, float32): decode 46 ms; verify k = 1, 2, 4, 8, 16:
3.2x, 3.9x, 6.1x, 9.0x, 15.8x a decode step; re-feed n = 0: 1.0x, n = 4: 7.9x. On this CPU a 2-token pass costs
3x a 1-token one: the multi-token path is compute-bound here and takes other kernels (up to ``KEY_BLOCK`` = 512 cached
keys the MLA ``fused`` path expands per-head keys and values over the cache for T > 1; the KDA core is compiled only
for T == 1), so speculation
cannot pay on CPU for that model. One forward pass of T tokens after S cached ones on that model (ms, CPU):

    S, T       1      2      3      5      9
    1        46     82    119    208    355    (~40 ms per token: compute-bound, and a MoE pass of T tokens
    256      45    137    169    246    394     reads up to T x top-k experts' weights, not top-k)
    1024     51    308    348    418    547    (T > 1 adds a cost that grows with S: the MLA path for T > 1)

So a cheap verify needs (1) an MLA path for small T whose cost per cached key is that of decode (absorbed, latent
space), and (2) on MoE models, expect the pass to read more experts than a decode step (drafts that route alike
help). The issue's cost curve needs a Mac, where a 2..17-token pass is weight-bound: that measurement decides whether
the per-step-state rollback is worth building.

Not done (for the next session):
- hidden-state drafters (DSpark; see above);
- a cheap small-T verify path: MLA absorbed attention for T = 2..17 (``ops/mla_attention.py`` takes ``fused``, expanded
  for T > 1, while the cache fits one key block), the compiled KDA core for small T; then the cost curve on a Mac, and the per-step
  KDA states option if re-feeds show up there;
- surfaces: ``serve --draft`` (batch of one per request; continuous batching needs per-row accepted counts, i.e.
  ragged rollback of a batched cache), ``usage`` in the server;
- the realistic workload (a LoRA copy-with-edits demo model) and mlx-lm's refusal as the baseline;
- ``stream_generate`` with ``draft=`` runs its own prefill (no image prefill, no ``generate_step`` async pipelining:
  the loop syncs once per pass).
"""

from .accept import TargetSampling, accept_greedy, accept_sampled
from .adaptive import DraftLength
from .draft_model import DraftModel, check_draft_vocab
from .drafts import Drafter, InContext, PromptLookup, make_drafter
from .loop import Speculation, check_speculative_sampling, propose_drafts, speculative_steps, verify_step
from .verify import rollback, verify_pass

__all__ = [
    "DraftModel", "Drafter", "DraftLength", "InContext", "PromptLookup", "Speculation", "TargetSampling",
    "accept_greedy", "accept_sampled", "check_draft_vocab", "check_speculative_sampling", "make_drafter",
    "propose_drafts", "rollback", "speculative_steps", "verify_pass", "verify_step",
]
