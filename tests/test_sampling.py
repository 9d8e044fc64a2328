"""Sampling options against their formulas (computed here with numpy) on fixed logits and on the demo model's
logits, and their way from ``generate``, ``stream_generate``, ``batch_generate``, ``ChatSession`` and the CLI flags
to the sampler; ``SamplingParams`` refusing bad values by name, and its ``seed``."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx import batch_generate, generate, load, stream_generate
from kimi_mlx.chat.session import ChatSession
from kimi_mlx.sampling import SamplingParams, make_sampling

LOGITS = np.array([3.0, 2.2, 1.9, 1.0, 0.3, -0.4, -1.5, -2.5])  # distinct and well apart: unambiguous supports
HISTORY = [2] + [5, 0, 5, 6, 3, 5, 0, 5, 6, 5] * 2  # id 2 just out of the 20-token window; 5, 0, 6, 3 repeat
CONTEXT = 20  # the penalties count the last 20 tokens
DRAWS = 20_000
TOL = 1e-4  # logits recomputed in one forward pass differ from the generation's step-by-step ones by ~1e-5
PROMPT = "The quick brown fox"
MAX_TOKENS = 24
SEED = 11
# Option sets in which each option decides the output: hot sampling and a tight filter, strong penalties.
CLI_CASES = [dict(temp=5.0, top_k=2), dict(temp=5.0, top_p=0.5, repetition_penalty=3.0), dict(temp=5.0, min_p=0.5)]
CASES = CLI_CASES + [dict(presence_penalty=5.0), dict(frequency_penalty=5.0), dict(logit_bias={126: 10.0})]  # "~"


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def np_support(logits: np.ndarray, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Which tokens top_k (the k largest), top_p (those whose more probable tokens hold < top_p of the mass) and
    min_p (p >= min_p * max p) keep, on the probabilities softmax(logits)."""
    p = softmax(logits)
    keep = np.ones(len(p), bool)
    if top_k:
        keep &= logits >= np.sort(logits)[-top_k]
    if top_p < 1.0:
        keep &= np.array([p[p > q].sum() < top_p for q in p])
    if min_p:
        keep &= p >= min_p * p.max()
    return keep


def np_probs(logits: np.ndarray, temp=0.0, **filters) -> np.ndarray:
    """The sampling distribution: softmax(logits / temp) on the support (one-hot on the argmax when temp is 0)."""
    if temp == 0:
        return np.eye(len(logits))[np.argmax(logits)]
    keep = np_support(logits, **filters)
    return softmax(np.where(keep, logits / temp, -np.inf))


def np_processed(logits, history, logit_bias=None, repetition_penalty=None, presence_penalty=None,
                 frequency_penalty=None) -> np.ndarray:
    """The logits plus logit_bias, then over the last 20 ids of history: / repetition_penalty (* when negative),
    minus presence_penalty once per id, minus frequency_penalty per occurrence."""
    out = np.array(logits, np.float64)
    for i, bias in (logit_bias or {}).items():
        out[i] += bias
    recent = list(history)[-CONTEXT:]
    seen = sorted(set(recent))
    if repetition_penalty:
        out[seen] = np.where(out[seen] < 0, out[seen] * repetition_penalty, out[seen] / repetition_penalty)
    if presence_penalty:
        out[seen] -= presence_penalty
    if frequency_penalty:
        np.subtract.at(out, recent, frequency_penalty)
    return out


@pytest.mark.parametrize("options", [
    dict(temp=0.0), dict(temp=0.5), dict(temp=2.0), dict(temp=1.0, top_k=2), dict(temp=1.0, top_p=0.8),
    dict(temp=1.0, min_p=0.1), dict(temp=1.5, top_k=5, top_p=0.9, min_p=0.15),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_sampler_draws_follow_the_formula(options):
    """20000 seeded draws from fixed logits: no id outside the formula's support, and each id's frequency within 5
    standard errors of its probability softmax(logits / temp) on that support (so every id of p >~ 0.002 drawn)."""
    want = np_probs(LOGITS, **options)
    sampler, _ = make_sampling(SamplingParams(**options))
    logprobs = mx.array(np.log(softmax(LOGITS)), mx.float32)
    mx.random.seed(0)
    draws = np.array(sampler(mx.broadcast_to(logprobs, (DRAWS, len(LOGITS)))))
    freq = np.bincount(draws, minlength=len(LOGITS)) / DRAWS
    assert set(np.unique(draws)) <= set(np.flatnonzero(want))
    assert np.all(np.abs(freq - want) <= 5 * np.sqrt(want * (1 - want) / DRAWS)), (freq.round(4), want.round(4))


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.5), dict(presence_penalty=0.7), dict(frequency_penalty=0.4),
    dict(logit_bias={0: -2.0, 7: 3.5}),
    dict(logit_bias={5: 1.0, 1: -0.5}, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4),
], ids=lambda o: ",".join(o))
def test_logits_processors_follow_the_formula(options):
    """On fixed logits (some negative) and a history with repeated ids and an id just out of the 20-token window,
    the logits processors give the formula's logits (bias first, then the penalties)."""
    _, processors = make_sampling(SamplingParams(**options))
    logits = mx.array(LOGITS[None], mx.float32)
    for process in processors:
        logits = process(mx.array(HISTORY), logits)
    np.testing.assert_allclose(np.array(logits[0]), np_processed(LOGITS, HISTORY, **options), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def demo():
    return load("demo", dtype=mx.float32)


def _draw(demo, prompt_ids, **options) -> list[int]:
    mx.random.seed(SEED)
    return [r.token for r in stream_generate(*demo, prompt_ids, MAX_TOKENS, **options)]


def _step_logits(model, prompt_ids, tokens) -> np.ndarray:
    """The model's logits before each of ``tokens``, from one forward pass over the prompt and the tokens."""
    logits = model(mx.array(prompt_ids + tokens[:-1])[None])[0, len(prompt_ids) - 1 :]
    return np.array(logits, np.float64)


def _kept(logits, token, **filters) -> bool:
    """``token`` is in the support up to TOL (a margin for the recomputed logits)."""
    return bool(np_support(logits + TOL * (np.arange(len(logits)) == token), **filters)[token])


@pytest.mark.parametrize("options", [
    dict(temp=5.0), dict(temp=5.0, top_k=3), dict(temp=5.0, top_p=0.6), dict(temp=5.0, min_p=0.3),
], ids=lambda o: ",".join(o))
def test_stream_generate_samples_among_the_options_candidates(demo, options):
    """Hot seeded sampling on the demo model: every token is in the support the formula gives for its step's
    logits (recomputed independently), and some token is not the step's argmax (the sampling is not greedy)."""
    model, tok = demo
    ids = tok.encode(PROMPT)
    tokens = _draw(demo, ids, **options)
    filters = {k: v for k, v in options.items() if k != "temp"}
    logits = _step_logits(model, ids, tokens)
    assert all(_kept(step, t, **filters) for step, t in zip(logits, tokens))
    assert any(step[t] < step.max() - TOL for step, t in zip(logits, tokens))


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=2.0), dict(presence_penalty=2.0), dict(frequency_penalty=1.0),
    dict(logit_bias={101: 3.0, 88: -3.0}),  # "e" up, "X" down (the demo tokenizer's id of a byte is its value)
], ids=lambda o: ",".join(o))
def test_stream_generate_applies_the_logits_processors(demo, options):
    """Greedy on the demo model: every token is the argmax of its step's logits changed by the formula (history:
    the prompt and the tokens so far), and at some step that is not the argmax of the unchanged logits."""
    model, tok = demo
    ids = tok.encode(PROMPT)
    tokens = _draw(demo, ids, **options)
    logits = _step_logits(model, ids, tokens)
    changed = [np_processed(step, ids + tokens[:i], **options) for i, step in enumerate(logits)]
    assert all(step[t] >= step.max() - TOL for step, t in zip(changed, tokens))
    assert any(raw[step.argmax()] < raw.max() - TOL for raw, step in zip(logits, changed))


def _assert_made_by(got, options: dict, reference) -> None:
    """``got`` is ``reference(options, SEED)`` and no variant: without any one of the options (or, when sampling,
    with another seed) the reference changes, so an option or the seed lost on the way would show."""
    assert got == reference(options, SEED)
    for key in options:
        assert reference({k: v for k, v in options.items() if k != key}, SEED) != got, f"{key} changes nothing here"
    if options.get("temp"):
        assert reference(options, SEED + 1) != got, "the seed changes nothing here"


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(o))
def test_generate_passes_the_options(demo, options):
    """Seeded ``generate`` returns the text ``stream_generate`` draws with the same options."""
    def streamed(options, seed):
        mx.random.seed(seed)
        return "".join(r.text for r in stream_generate(*demo, PROMPT, MAX_TOKENS, **options))

    mx.random.seed(SEED)
    _assert_made_by(generate(*demo, PROMPT, MAX_TOKENS, **options), options, streamed)


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(o))
def test_chat_session_passes_the_options(demo, options):
    """A seeded ``ChatSession(sampling=...)`` reply is what ``stream_generate`` draws with the same options,
    continuing a cache of the prompt but its last token (as the session generates)."""
    model, tok = demo
    session = ChatSession(model, tok, max_tokens=MAX_TOKENS, sampling=options)
    mx.random.seed(SEED)
    list(session.send("Hi"))
    reply = session.last.tokens
    prompt = session.tokens[: len(session.tokens) - len(reply)]

    def continued(options, seed):
        cache = model.make_cache()
        model(mx.array(prompt[:-1])[None], cache=cache)
        mx.random.seed(seed)
        return [r.token for r in stream_generate(model, tok, prompt[-1:], MAX_TOKENS, prompt_cache=cache, **options)]

    _assert_made_by(reply, options, continued)


def _cli(tmp_path, command: str, options: dict, *flags: str, stdin=None) -> str:
    """stdout of ``kimi-mlx COMMAND`` on the demo model with ``options`` as flags and --seed SEED."""
    sampling = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    out = subprocess.run(
        [sys.executable, "-m", "kimi_mlx.cli.main", command, "--model", "demo", "--dtype", "float32",
         "--max-tokens", str(MAX_TOKENS), "--seed", str(SEED), *sampling, *flags],
        input=stdin, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("options", CLI_CASES, ids=lambda o: ",".join(o))
def test_cli_generate_passes_the_sampling_flags(demo, tmp_path, options):
    """``kimi-mlx generate`` with sampling flags and --seed prints what ``generate`` returns with those options
    after ``mx.random.seed``."""
    def generated(options, seed):
        mx.random.seed(seed)
        return generate(*demo, PROMPT, MAX_TOKENS, **options)

    got = json.loads(_cli(tmp_path, "generate", options, "--prompt", PROMPT, "--json"))["text"]
    _assert_made_by(got, options, generated)


@pytest.mark.parametrize("options", CLI_CASES, ids=lambda o: ",".join(o))
def test_cli_chat_passes_the_sampling_flags(demo, tmp_path, options):
    """``kimi-mlx chat`` with sampling flags and --seed shows the reply a ``ChatSession`` with those options gives
    after ``mx.random.seed``."""
    def replied(options, seed):
        session = ChatSession(*demo, max_tokens=MAX_TOKENS, sampling=options)
        mx.random.seed(seed)
        return "".join(event.text for event in session.send("Hi") if event.kind == "content")

    shown = _cli(tmp_path, "chat", options, stdin="Hi\n").split(">>> ", 1)[1].split("\n[prompt ", 1)[0]
    _assert_made_by(shown, options, replied)


@pytest.mark.parametrize("name,value", [
    ("temp", -0.5), ("temp", float("nan")), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5), ("min_p", 2.0),
    ("repetition_penalty", -1.0), ("presence_penalty", "high"), ("logit_bias", {"a": 1.0}), ("seed", 1.5),
    ("sampler", 3), ("logits_processors", [None]),
])
def test_sampling_params_name_the_bad_option(name, value):
    """A bad option value is refused when the params are made, and the error names the option."""
    with pytest.raises(ValueError, match=f"sampling: {name} is "):
        SamplingParams(**{name: value})


def test_unknown_options_are_refused_by_name(demo):
    """An unknown sampling keyword of ``stream_generate`` (or ``updated``) is refused, naming it and the options."""
    with pytest.raises(ValueError, match="unknown option\\(s\\) temperature; expected temp, top_p"):
        list(stream_generate(*demo, PROMPT, 2, temperature=0.5))
    with pytest.raises(ValueError, match="unknown option\\(s\\) topk"):
        SamplingParams().updated(topk=3)


def test_seed_option_draws_as_mx_random_seed(demo):
    """``seed=S`` (keyword, or in ``sampling=``) draws what ``mx.random.seed(S)`` then the same call draws."""
    ids = demo[1].encode(PROMPT)
    want = _draw(demo, ids, temp=5.0)
    mx.random.seed(SEED + 1)
    assert [r.token for r in stream_generate(*demo, ids, MAX_TOKENS, temp=5.0, seed=SEED)] == want
    params = SamplingParams(temp=5.0, seed=SEED)
    assert [r.token for r in stream_generate(*demo, ids, MAX_TOKENS, sampling=params)] == want


def test_batch_generate_applies_the_options_per_row(demo):
    """``batch_generate`` with a penalty gives each row what it gives that prompt alone (each row's penalties see
    its own prompt and reply), and the penalty changes the greedy reply."""
    model, tok = demo
    prompts = [tok.encode(PROMPT), tok.encode("Zebras jog over 42 lazy dogs")]
    rows, _ = batch_generate(model, prompts, 12, repetition_penalty=2.0)
    alone = [batch_generate(model, [p], 12, sampling=SamplingParams(repetition_penalty=2.0))[0][0] for p in prompts]
    assert rows == alone
    assert batch_generate(model, prompts, 12)[0] != rows
