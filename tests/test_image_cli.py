"""``kimi-mlx generate --image`` and ``kimi-mlx chat``'s ``/image`` as subprocesses on the K3 vision fixture:
``generate --image`` renders mlx-vlm's two-image prompt and gives the Python API's tokens; ``/image`` + ``/save`` +
``/load`` (and ``--load``) restore the same images, tokens and replies; a missing file, an unreadable image, a text-only
model and ``--prompt-cache`` with images are one-line errors (exit 2, no traceback)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pexpect
import pytest
from conftest import SHARED

ROOT = SHARED / "fixtures" / "k3_vision"
CKPT = ROOT / "k3-vl-tiny"
IMG0, IMG2 = ROOT / "images" / "img0_rgb_224x168.png", ROOT / "images" / "img2_palette_150x90.png"
PROMPTS = json.loads((ROOT / "manifest.json").read_text())["mlx_vlm"]["prompts"]
STATS = re.compile(r"\[prompt (\d+) tok \((\d+) prefilled\) [\d.]+ tok/s \| generation (\d+) tok [\d.]+ tok/s \| "
                   r"peak memory [\d.]+ GB \| (\w+)\]")
PROMPT = ">>> "


KIMI = str(Path(sys.executable).parent / "kimi-mlx")  # the installed command (a source checkout's cwd would shadow it)


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([KIMI, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_generate_image_gives_the_python_apis_tokens():
    from kimi_mlx import generate, load, stream_generate

    out = _cli("generate", "--model", str(CKPT), "--dtype", "float32", "--image", str(IMG0), "--image", str(IMG2),
               "--prompt", "What differs between these two pictures?", "-m", "6", "--json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    ref = PROMPTS["two_images"]
    assert got["stats"]["prompt_tokens"] == ref["n_tokens"] and got["stats"]["image_tokens"] == 48 + 24
    model, tok = load(CKPT, dtype=mx.float32)
    messages = [{"role": "user", "content": [{"type": "image", "image": IMG0}, {"type": "image", "image": IMG2},
                                             {"type": "text", "text": "What differs between these two pictures?"}]}]
    assert got["text"] == generate(model, tok, messages, 6)
    first = next(iter(stream_generate(model, tok, ref["input_ids"], 1, images=[IMG0, IMG2])))
    assert first.token == ref["argmax_last"]


def test_generate_image_errors_are_one_line(tmp_path, kl_dir):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    cases = [
        (["--model", str(CKPT), "--image", str(tmp_path / "nope.png")], f"--image {tmp_path / 'nope.png'}: no such file"),
        (["--model", str(CKPT), "--image", str(tmp_path / "bad.png")],
         f"--image {tmp_path / 'bad.png'}: image file '{tmp_path / 'bad.png'}' is not a readable image"),
        (["--model", str(kl_dir / "hf"), "--image", str(IMG0)], "--image: Kimi Linear is a text-only model"),
        (["--model", str(CKPT), "--image", str(IMG0), "--prompt-cache", str(tmp_path / "c.safetensors")],
         "--prompt-cache is not supported with --image"),
    ]
    for flags, message in cases:
        out = _cli("generate", *flags, "--prompt", "Hi", "-m", "1")
        assert out.returncode == 2, out.stderr
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert lines[-1] == f"kimi-mlx: error: {message}" or lines[-1].startswith(f"kimi-mlx: error: {message}")
        assert "Traceback" not in out.stderr


def _spawn(cwd, *flags) -> pexpect.spawn:
    child = pexpect.spawn(KIMI, ["chat", "--model", str(CKPT), "--dtype",
                                           "float32", "-m", "6", *flags],
                          cwd=str(cwd), encoding="utf-8", timeout=180, dimensions=(50, 400))
    child.expect(r"\(kimi_k3 format\)")
    child.expect_exact(PROMPT)
    return child


def _turn(child, line: str) -> tuple[str, tuple[int, int, int]]:
    child.sendline(line)
    child.expect(STATS)
    reply = child.before.replace("\r\n", "\n").split("\n", 1)[-1]
    stats = tuple(int(x) for x in child.match.groups()[:3])
    child.expect_exact(PROMPT)
    return reply, stats


def _command(child, line: str, expect: str) -> str:
    child.sendline(line)
    child.expect(expect)
    text = child.match.group(0)
    child.expect_exact(PROMPT)
    return text


def test_chat_image_save_load_round_trip(tmp_path):
    from kimi_mlx import load
    from kimi_mlx.chat.session import ChatSession

    saved = tmp_path / "chat.safetensors"
    a = _spawn(tmp_path)
    _command(a, f"/image {IMG2}", re.escape(f"[image {IMG2} (150x90, 24 tokens) attached to your next message]"))
    _, (p1, f1, _) = _turn(a, "Describe this image.")
    assert p1 == f1 == PROMPTS["img2_palette_150x90"]["n_tokens"]  # mlx-vlm's prompt for this image
    _command(a, f"/save {saved}", r"\[saved 2 messages with 1 image, \d+ tokens to ")
    _command(a, f"/image {IMG0}", r"attached to your next message\]")
    reply2, stats2 = _turn(a, "And this one?")
    _command(a, "/reset", re.escape("[conversation cleared]"))
    _command(a, f"/load {saved}", r"\[loaded 2 messages with 1 image, \d+ tokens from ")
    _command(a, f"/image {IMG0}", r"attached to your next message\]")
    again, stats_again = _turn(a, "And this one?")
    a.sendline("/exit")
    a.expect(pexpect.EOF)

    b = _spawn(tmp_path, "--load", str(saved))
    _command(b, f"/image {IMG0}", r"attached to your next message\]")
    reply_b, stats_b = _turn(b, "And this one?")
    b.sendline("/exit")
    b.expect(pexpect.EOF)
    # the same reply and prompt; a loaded session keeps one checkpoint (at its end), and the random model's reply
    # renders back differently, so it prefills from the start where the running session had a checkpoint
    assert again == reply_b == reply2 and stats_again == stats_b
    assert (stats_b[0], stats_b[2]) == (stats2[0], stats2[2])

    model, tok = load(CKPT, dtype=mx.float32)
    s = ChatSession(model, tok)
    s.load(saved)
    (image,) = [p["image"] for p in s.messages[0]["content"] if p.get("type") == "image"]
    assert image.digest == model.image_encoder.prepare(IMG2).digest and image.size == (150, 90)


def test_chat_image_errors(tmp_path, kl_dir):
    (tmp_path / "bad.png").write_bytes(b"not an image")
    child = _spawn(tmp_path)
    _command(child, f"/image {tmp_path / 'nope.png'}",
             re.escape(f"[error: /image {tmp_path / 'nope.png'}: image file '{tmp_path / 'nope.png'}' does not "
                       "exist or is not a file]"))
    _command(child, f"/image {tmp_path / 'bad.png'}", r"\[error: /image .*bad.png: image file .* is not a readable")
    _command(child, "/image", re.escape("[error: usage: /image PATH]"))
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    kl = pexpect.spawn(KIMI, ["chat", "--model", str(kl_dir / "hf")],
                       cwd=str(tmp_path), encoding="utf-8", timeout=180, dimensions=(50, 400))
    kl.expect_exact(PROMPT)
    kl.sendline(f"/image {IMG0}")
    kl.expect(r"\[error: /image \S+: Kimi Linear is a text-only model: it takes no images\]")
    kl.sendline("/exit")
    kl.expect(pexpect.EOF)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_says_how_images_go_in(command):
    out = _cli(command, "--help")
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    assert ("--image PATH" in text and "implies --chat" in text) if command == "generate" else (
        "/image PATH attaches an image to your next message" in text)
