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
- ``adaptive``: ``DraftLength``, the next draft length from the recent acceptance, and the cost-aware off switch
  (off while the expected tokens per pass at the measured acceptance do not pay for the pass; exponential back-off
  between probes).
- ``loop``: ``speculative_steps`` (batch of one): prefill, then draft / verify / accept / roll back / adapt, yielding
  ``(token, logprobs, Speculation)``; it calls a drafter's ``prepare`` first and passes its ``draft_probs`` as q
  (``propose_drafts``). Its pass, ``verify_step`` (verify + processors + acceptance, before the rollback), is also
  the server engine's speculative turn (``kimi_mlx.server.scheduler``). While speculation is off it runs plain
  decode steps pipelined as mlx-lm's ``generate_step`` (the next forward built before the current token is read).

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

Measurements (bench/bench_speculative.py prints the cost curve k = 1..16, the cost model's speed-up table for the
measured curve and for a weight-bound one, forced-acceptance and low-acceptance runs; bench/README.md has the
commands). On the Linux CPU backend (float32, 2 shared cores) a verify pass of 1 + k tokens costs ~1 + 0.2 k (demo
model) to ~1 + 0.26 k (bench model) decode steps and a re-feed of n + 1 tokens about a pass of n drafts, so
speculation pays there from a per-draft acceptance of ~0.65-0.9 depending on k; with drafts all accepted, k = 8:
2.8x plain decoding on the demo model, 2.4x on the bench model. Random prompts with ``draft="lookup"`` and the
adaptive length: 0.97-1.02x plain (medians over 5-9 interleaved rounds).

Bench model of bench_vs_mlx_lm.py (hidden 768, 12 layers, float32), an earlier measurement: a 2-token pass cost
up to 3x a 1-token one: the multi-token path is compute-bound here and takes other kernels (up to ``KEY_BLOCK`` = 512
cached keys the MLA ``fused`` path expands per-head keys and values over the cache for T > 1; the KDA core is
compiled only for T == 1). One forward pass of T tokens after S cached ones on that model (ms, CPU):

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
- ``stream_generate`` with ``draft=`` runs its own prefill (no image prefill); drafting passes sync once per pass
  (the stretches with speculation off run pipelined);
- the adaptive length's cost model has no term for a draft model's own cost per drafted token.
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
