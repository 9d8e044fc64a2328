"""``kimi-mlx chat`` driven through a pseudo-terminal (pexpect) on the demo model, and the REPL's display of
reasoning / tool calls / warnings on a scripted event stream."""

import io
import re
import signal
import sys

import pexpect
import pytest

from kimi_mlx.chat.session import ChatEvent, Turn, TurnStats
from kimi_mlx.cli.chat import Repl

STATS = re.compile(
    r"\[prompt (\d+) tok \((\d+) prefilled\) [\d.]+ tok/s \| generation (\d+) tok [\d.]+ tok/s \| "
    r"peak memory [\d.]+ GB \| (\w+)\]"
)
PROMPT = ">>> "


def _spawn(tmp_path, *flags) -> pexpect.spawn:
    child = pexpect.spawn(
        sys.executable, ["-m", "kimi_mlx.cli.main", "chat", "--model", "demo", *flags],
        cwd=str(tmp_path), encoding="utf-8", timeout=120, dimensions=(50, 400),
        # a terminal's Ctrl-C must reach the REPL even when the suite itself runs with SIGINT ignored (a background
        # job of a non-interactive shell), which an exec'd child would inherit
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child.expect(r"kimi-mlx chat: demo \(kimi_linear format\)")
    child.expect_exact(PROMPT)
    return child


def _turn(child, line: str) -> tuple[str, tuple[int, int, int, str]]:
    """Send ``line``; returns (the reply text shown, (prompt tokens, prefilled, generated, finish reason))."""
    child.sendline(line)
    child.expect(STATS)
    shown = child.before.replace("\r\n", "\n").split("\n")
    assert shown[0].endswith(line), shown
    stats = child.match.groups()
    child.expect_exact(PROMPT)
    return "\n".join(shown[1:]).strip("\n"), (int(stats[0]), int(stats[1]), int(stats[2]), stats[3])


def _assert_saved_cache_is_fresh(file) -> None:
    """The cache arrays in a /save file equal those of a fresh prefill of the tokens saved with them, within 1.5e-5
    (float32 noise of prefill + decode steps vs one prefill: measured up to 2.3e-6 here, 5.1e-6 in
    test_chat_session)."""
    import mlx.core as mx

    from kimi_mlx import load
    from kimi_mlx.cache import KDACache

    saved = mx.load(str(file))
    model, _ = load("demo")
    fresh = model.make_cache()
    mx.eval(model(saved["tokens"][None], cache=fresh))
    want = {"tokens": saved["tokens"]}
    for i, c in enumerate(fresh):
        names = ("conv_state", "recurrent_state") if isinstance(c, KDACache) else ("kv_latent", "k_pe")
        want.update({f"layers.{i}.{name}": a for name, a in zip(names, c.state)})
    assert saved.keys() == want.keys()
    for key, a in saved.items():
        assert a.shape == want[key].shape, f"{key}: shape {a.shape}, expected {want[key].shape}"
        err = mx.abs(a - want[key]).max().item()
        assert err <= 1.5e-5, f"{key}: max |difference| {err:.3g} from a fresh prefill"


def test_repl_two_turns_regenerate_save_load_exit(tmp_path):
    """Two turns (the second prefills only its new tokens), /regenerate (1 token prefilled, same greedy reply),
    /save, /reset, /load (4 messages back, the next turn reuses the loaded cache), /stats, Ctrl-D quits with 0."""
    child = _spawn(tmp_path, "--max-tokens", "24", "--system", "Be brief.")
    reply1, (p1, f1, g1, why1) = _turn(child, "Hello there")
    assert reply1 and (f1, g1, why1) == (p1, 24, "length")
    reply2, (p2, f2, g2, _) = _turn(child, "Tell me more")
    assert p2 > p1 + g1 and f2 == p2 - (p1 + g1)  # only the new tokens were prefilled

    again, (p3, f3, _, _) = _turn(child, "/regenerate")
    assert again == reply2 and (p3, f3) == (p2, 1)

    child.sendline(f"/save {tmp_path / 'chat.safetensors'}")
    child.expect(r"\[saved 4 messages, (\d+) tokens to ")
    saved_tokens = int(child.match.group(1))
    assert saved_tokens == p2 + 24
    child.expect_exact(PROMPT)
    child.sendline("/reset")
    child.expect_exact("[conversation cleared]")
    child.expect_exact(PROMPT)
    child.sendline(f"/load {tmp_path / 'chat.safetensors'}")
    child.expect_exact(f"[loaded 4 messages, {saved_tokens} tokens from ")
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect(rf"\[turns \d+ \| messages 4 \| context {saved_tokens} tokens \| cache [\d.]+ MB with 1 checkpoints\]")
    child.expect_exact(PROMPT)
    _, (p4, f4, _, _) = _turn(child, "And finally?")
    assert f4 == p4 - saved_tokens

    child.sendline("/nonsense")
    child.expect_exact("[error: unknown command '/nonsense' (/help lists them)]")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_repl_ctrl_c_stops_the_reply_and_keeps_the_session(tmp_path):
    """Ctrl-C while a (very long) reply streams: "[interrupted]", a stats line marked interrupted, the prompt comes
    back, /stats still shows the exchange, /save writes the cache of a fresh prefill of the tokens kept (wherever the
    signal landed: in a model call, the cache is rolled back), and /exit quits with 0."""
    child = _spawn(tmp_path, "--max-tokens", "100000")
    child.sendline("Write a long story")
    child.expect(r"Write a long story\r\n[^\r\n]{8}")
    child.sendintr()
    child.expect_exact("[interrupted]")
    child.expect(STATS)
    assert child.match.group(4) == "interrupted" and 8 <= int(child.match.group(3)) < 100000
    child.expect_exact(PROMPT)
    child.sendline("/stats")
    child.expect(r"\[turns 1 \| messages 2 \| context \d+ tokens")
    child.expect_exact(PROMPT)
    child.sendline(f"/save {tmp_path / 'stopped.safetensors'}")
    child.expect_exact("[saved 2 messages, ")
    child.expect_exact(PROMPT)
    _assert_saved_cache_is_fresh(tmp_path / "stopped.safetensors")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_repl_refuses_bad_tools_file(tmp_path):
    """A --tools file that is not a JSON list: exit status 2 and an error naming the file."""
    (tmp_path / "tools.json").write_text('{"not": "a list"}')
    child = pexpect.spawn(
        sys.executable, ["-m", "kimi_mlx.cli.main", "chat", "--model", "demo", "--tools", "tools.json"],
        cwd=str(tmp_path), encoding="utf-8", timeout=120,
    )
    child.expect(r"tools\.json: expected a JSON list of tool declarations")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2


class _ScriptedSession:
    """Stands in for ChatSession: replays a reasoning + content + tool-call reply, then records the tool results."""

    CALL = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}

    def __init__(self):
        self.last, self.results = None, None

    def reply(self):
        yield ChatEvent("reasoning", "Need the ")
        yield ChatEvent("reasoning", "tool.")
        yield ChatEvent("content", "Checking.")
        yield ChatEvent("tool_call", tool_call=self.CALL)
        self.last = Turn({"role": "assistant"}, TurnStats(finish_reason="stop"), [1], [self.CALL])

    def tool_results(self, results):
        self.results = results
        yield ChatEvent("content", "It is 22C and sunny.")
        yield ChatEvent("warning", "the reply ended inside the response section (cut off?)")
        self.last = Turn({"role": "assistant"}, TurnStats(finish_reason="length"), [2], [])


@pytest.mark.parametrize("hide", [False, True])
def test_repl_shows_reasoning_tool_calls_and_warnings(monkeypatch, hide):
    """Reasoning is set apart ("[reasoning]" off a terminal) or hidden with --hide-reasoning; a tool call is shown
    as name(arguments), its result is asked for and handed to the session, and the continuation and a parser
    warning are printed."""
    session, out = _ScriptedSession(), io.StringIO()
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "22C sunny")
    Repl(session, hide_reasoning=hide, out=out).stream(session.reply())
    text = out.getvalue()
    assert ("[reasoning] Need the tool.\nChecking." in text) != hide
    assert ("Need the tool" in text) != hide and "Checking." in text
    assert '[tool call] get_weather({"city": "Tokyo"})' in text
    assert asked == ['result of get_weather({"city": "Tokyo"})> ']
    assert session.results == [(_ScriptedSession.CALL, "22C sunny")]
    assert "It is 22C and sunny.\n[warning: the reply ended inside the response section (cut off?)]" in text
    assert text.count("[prompt 0 tok") == 2


def _generate(capsys, *flags) -> tuple[int, str, str]:
    from kimi_mlx.cli.main import main

    rc = main(["generate", "--model", "demo", *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_chat_json(capsys):
    """`generate --chat --system --json`: one JSON object whose content is the greedy reply to the rendered chat
    (system + user message), with stats; the same flags without --json stream that text."""
    import json

    import mlx.core as mx

    from kimi_mlx import generate, load
    from kimi_mlx.chat.format import render_chat

    rc, out, _ = _generate(capsys, "--prompt", "Hi there", "--chat", "--system", "Be brief.", "-m", "8", "--json")
    assert rc == 0
    got = json.loads(out)
    model, tok = load("demo", dtype=mx.float32)
    prompt = render_chat(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    assert got["content"] == got["text"] == generate(model, tok, prompt, 8) and got["reasoning"] == ""
    assert got["tool_calls"] == [] and got["stats"]["prompt_tokens"] == len(prompt)
    assert got["stats"]["generation_tokens"] == 8 and got["stats"]["finish_reason"] == "length"
    rc, out, err = _generate(capsys, "--prompt", "Hi there", "--chat", "--system", "Be brief.", "-m", "8")
    assert rc == 0 and out.strip() == got["text"].strip() and "generation: 8 tokens" in err


def test_generate_seed_and_flag_errors(capsys):
    """--seed makes sampling repeatable; chat-only flags without --chat, and --think on Kimi Linear, exit 2 with a
    message saying why."""
    runs = [_generate(capsys, "--prompt", "Hi", "-m", "12", "--temp", "1.0", "--seed", "5", "--quiet")[1]
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0].strip()
    rc, _, err = _generate(capsys, "--prompt", "Hi", "--think")
    assert rc == 2 and "--think/--no-think needs --chat" in err
    rc, _, err = _generate(capsys, "--prompt", "Hi", "--chat", "--think")
    assert rc == 2 and "no thinking section" in err


def test_repl_context_full_message(monkeypatch):
    """With --max-kv-size, the REPL prints the context-full message when a reply reaches the limit and when the next
    message no longer fits, and keeps running."""
    import mlx.core as mx

    from kimi_mlx import load
    from kimi_mlx.chat.session import ChatSession

    model, tok = load("demo", dtype=mx.float32)
    probe = ChatSession(model, tok)
    probe.messages.append({"role": "user", "content": "Hi"})
    limit = len(probe.render()) + 4
    lines = iter(["Hi", "More please", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    out = io.StringIO()
    Repl(ChatSession(model, tok, max_tokens=50, max_kv_size=limit), hide_reasoning=False, out=out).loop()
    text = out.getvalue()
    assert "[context full: the reply stopped at the limit (max_kv_size" in text and "| context]" in text
    assert "[error: context full: the conversation is " in text and f"the limit (max_kv_size) is {limit};" in text
    assert text.count("| context]") == 1  # the refused message produced no reply


def test_generate_adapter_path(tmp_path, capsys):
    """`generate --adapter-path DIR` applies a saved LoRA adapter (non-zero update): its greedy text equals the
    in-process generation with the same adapter loaded, and differs from the base model's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kimi_mlx import generate, load
    from kimi_mlx.tuner.adapters import adapter_config, apply_adapters, save_adapters

    model, tok = load("demo", dtype=mx.float32)
    base = generate(model, tok, "Hello", 16)
    paths = apply_adapters(model, ["model.layers.3.self_attn.o_proj", "model.layers.0.mlp.down_proj"], rank=4)
    bumped = [(k, mx.random.normal(v.shape, key=mx.random.key(1)) * 0.5) for k, v in
              tree_flatten(model.trainable_parameters()) if k.endswith("lora_b")]
    model.load_weights(bumped, strict=False)
    save_adapters(model, tmp_path / "ad", adapter_config(model, paths, "lora", 4, 20.0, 0.0, -1, ["o_proj"]))
    adapted, _ = load("demo", dtype=mx.float32, adapter_path=tmp_path / "ad")
    want = generate(adapted, tok, "Hello", 16)
    rc, out, _ = _generate(capsys, "--prompt", "Hello", "-m", "16", "--adapter-path", str(tmp_path / "ad"), "--quiet")
    assert rc == 0 and out == want + "\n" and want != base
