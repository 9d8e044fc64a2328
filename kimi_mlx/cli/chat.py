"""``kimi-mlx chat``: an interactive terminal chat on top of ``kimi_mlx.chat.session.ChatSession``.

Replies stream as they come; reasoning is dimmed (or hidden with ``--hide-reasoning``); tool calls are shown and their
results typed in; a stats line follows every reply. Ctrl-C stops the current reply and keeps the session; Ctrl-D or
``/exit`` quits. ``/image PATH`` (Kimi-K3 with a vision tower) attaches an image to the next message, before its text;
``/save`` stores each image's file in the saved session, so ``/load`` restores the same pixels.

With ``--parallel`` (under ``mlx.launch``) rank 0 reads each line and hands it to the other ranks, so every rank runs
the same commands and replies in lockstep; only rank 0 prints. There, Ctrl-C ends the whole run (the ranks could not
stop a reply at the same token), ``/save FILE`` / ``/load FILE`` / ``--load FILE`` save / load each rank's part of
the cache and the conversation (``NAME.safetensors`` on rank 0, ``NAME.rank{r}.safetensors`` on rank r; all ranks
succeed or fail together), and ``/exit`` quits (``mlx.launch`` does not pass end-of-input on to the ranks, so Ctrl-D does not).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from . import ranks
from ..parallel.comm import broadcast_text
from .flags import (add_chat_args, add_draft_args, add_kv_args, add_model_args, add_sampling_args, check_draft_args,
                    draft_from_args, draft_text, kv_from_args, load_from_args, sampling_from_args)

HELP = """commands:
  /reset              forget the conversation (settings stay)
  /system [TEXT]      set the system prompt (no TEXT: clear it)
  /think on|off       Kimi-K3 reasoning on or off
  /effort low|high|max  Kimi-K3 thinking effort
  /image PATH         attach an image to your next message (repeatable; Kimi-K3 with a vision tower)
  /regenerate         replace the last reply (the prompt comes from a cache checkpoint)
  /undo               remove the last exchange
  /save FILE          save the conversation (images included) and its cache to FILE (.safetensors)
  /load FILE          load a conversation saved with /save
  /stats              session statistics
  /help               this help
  /exit               quit (also Ctrl-D); Ctrl-C stops a reply"""

DIM, RESET, BOLD = "\x1b[2m", "\x1b[0m", "\x1b[1m"


def add_parser(commands) -> None:
    p = commands.add_parser("chat", description="Chat with a Kimi Linear / Kimi-K3 model in the terminal. /help lists "
                            "the commands; /image PATH attaches an image to your next message (Kimi-K3 with a vision "
                            "tower), and /save keeps it with the conversation.")
    add_model_args(p)
    add_sampling_args(p, max_tokens=512)
    add_draft_args(p)
    add_chat_args(p)
    add_kv_args(p)
    p.add_argument("--tools", default=None, metavar="FILE", help="JSON file with a list of tool declarations")
    p.add_argument("--hide-reasoning", action="store_true", help="do not show the reasoning, only the answer")
    p.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                   help="most tokens the conversation may hold (a clear message when it is full)")
    p.add_argument("--max-checkpoints", type=int, default=8, metavar="N",
                   help="cache checkpoints kept for /regenerate and /undo (memory: KDA state per checkpoint)")
    p.add_argument("--load", default=None, metavar="FILE", help="start from a conversation saved with /save")
    p.set_defaults(run=run)


def _read_tools(path: str) -> list:
    try:
        tools = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read the tools file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"{path}: expected a JSON list of tool declarations (objects)")
    return tools


class Repl:
    """The read-eval-print loop; ``out`` is where replies go (a terminal gets ANSI dimming)."""

    def __init__(self, session, hide_reasoning: bool, out=None, group=None):
        out = sys.stdout if out is None else out
        self.session, self.hide_reasoning, self.out = session, hide_reasoning, out
        self.color = out.isatty()
        self.group = group if ranks.is_parallel(group) else None  # --parallel: rank 0 reads, every rank runs
        self.pending: list = []  # images (PromptImages) attached to the next message

    def read(self, prompt: str) -> str:
        """A line typed by the user (``input``); under ``--parallel`` rank 0 reads it and every rank gets it (EOFError
        on every rank at the end of rank 0's input)."""
        if self.group is None:
            return input(prompt)
        line = None
        if self.group.rank() == 0:
            try:
                line = input(prompt)
            except EOFError:
                line = None
        line = broadcast_text(line, self.group)
        if line is None:
            raise EOFError
        return line

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def stream(self, events) -> None:
        """Print a streamed reply, then its stats line; Ctrl-C stops it (the partial reply is kept)."""
        from ..chat.session import ContextFullError

        shown = None
        try:
            for ev in events:
                if ev.kind == "reasoning":
                    if self.hide_reasoning:
                        continue
                    if shown != "reasoning":
                        self.write(DIM if self.color else "[reasoning] ")
                        shown = "reasoning"
                    self.write(ev.text)
                    continue
                if shown == "reasoning":
                    self.write((RESET if self.color else "") + "\n")
                shown = ev.kind
                if ev.kind == "content":
                    self.write(ev.text)
                elif ev.kind == "tool_call":
                    fn = ev.tool_call["function"]
                    self.write(f"\n[tool call] {fn['name']}({_args_text(fn.get('arguments'))})")
                else:
                    self.write(f"\n[warning: {ev.text}]")
        except KeyboardInterrupt:
            if self.group is not None:  # ranks cannot stop at the same token: Ctrl-C ends the run
                raise
            events.close()
            self.write((RESET if self.color and shown == "reasoning" else "") + "\n[interrupted]")
        except ContextFullError as e:
            self.write((RESET if self.color and shown == "reasoning" else "") + f"\n[{e}]")
        else:
            if shown == "reasoning" and self.color:
                self.write(RESET)
        self.write("\n")
        if self.session.last is not None:
            self.write(_stats_line(self.session.last.stats, _speculative(self.session)) + "\n")
            self.tool_round()

    def tool_round(self) -> None:
        """When the last reply called tools: ask for each result, then let the model continue."""
        calls = self.session.last.tool_calls if self.session.last else []
        if not calls:
            return
        results = []
        for call in calls:
            fn = call["function"]
            try:
                results.append((call, self.read(f"result of {fn['name']}({_args_text(fn.get('arguments'))})> ")))
            except (EOFError, KeyboardInterrupt) as e:
                if isinstance(e, KeyboardInterrupt) and self.group is not None:
                    raise
                self.write("\n[tool round abandoned: the calls stay unanswered]\n")
                return
        self.stream(self.session.tool_results(results))

    def command(self, line: str) -> bool:
        """Run a /command; returns False on /exit."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        s = self.session
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.write(HELP + "\n")
        elif name == "/reset":
            s.reset()
            self.pending = []
            self.write("[conversation cleared]\n")
        elif name == "/image":
            if not arg:
                raise ValueError("usage: /image PATH")
            image = s.attach(arg, f"/image {arg}")
            self.pending.append(image)
            width, height = image.size
            self.write(f"[image {arg} ({width}x{height}, {image.num_tokens} tokens) attached to your next message"
                       f"{'' if len(self.pending) == 1 else f'; {len(self.pending)} images'}]\n")
        elif name == "/system":
            s.system = arg or None
            self.write(f"[system prompt {'set' if arg else 'cleared'}]\n")
        elif name == "/think":
            if arg not in ("on", "off"):
                raise ValueError("usage: /think on|off")
            s.set_thinking(arg == "on")
            self.write(f"[thinking {arg}]\n")
        elif name == "/effort":
            s.set_effort(arg or None)
            self.write(f"[thinking effort {arg or 'default'}]\n")
        elif name == "/regenerate":
            self.stream(s.regenerate())
        elif name == "/undo":
            n = s.undo()
            self.write(f"[removed {n} message{'s' if n != 1 else ''}]\n")
        elif name == "/save":
            if not arg:
                raise ValueError("usage: /save FILE")
            with ranks.together(self.group, f"saving {arg}"):
                s.save(ranks.rank_path(arg, self.group))
            self.write(f"[saved {len(s.messages)} messages{_images_note(s.messages)}, {len(s.tokens)} tokens to "
                       f"{arg}]\n")
        elif name == "/load":
            if not arg:
                raise ValueError("usage: /load FILE")
            with ranks.together(self.group, f"loading {arg}"):  # every rank reads its part, then all take it
                saved = s.read_saved(ranks.rank_path(arg, self.group))
            s.restore(saved)
            self.pending = []
            self.write(f"[loaded {len(s.messages)} messages{_images_note(s.messages)}, {len(s.tokens)} tokens from "
                       f"{arg}]\n")
        elif name == "/stats":
            st = s.stats()
            self.write(
                f"[turns {st['turns']} | messages {st['messages']} | context {st['context_tokens']} tokens"
                f"{'' if st['max_kv_size'] is None else ' of ' + str(st['max_kv_size'])} | "
                f"cache {st['cache_mb']:.1f} MB with {st['checkpoints']} checkpoints]\n"
            )
            if s.last is not None:
                self.write(_stats_line(s.last.stats, _speculative(s)) + "\n")
        else:
            raise ValueError(f"unknown command {name!r} (/help lists them)")
        return True

    def loop(self) -> None:
        from ..prompt_cache import PromptCacheError

        while True:
            try:
                line = self.read(">>> ")
            except EOFError:
                self.write("\n")
                return
            except KeyboardInterrupt:
                if self.group is not None:
                    raise
                self.write("\n[Ctrl-C: /exit or Ctrl-D quits]\n")
                continue
            if not line.strip():
                continue
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        return
                else:
                    events = self.session.send(line, images=self.pending)
                    self.pending = []
                    self.stream(events)
            except (ValueError, OSError, PromptCacheError, RuntimeError) as e:
                self.write(f"[error: {e}]\n")


def _images_note(messages) -> str:
    """`` with N images`` for the image parts of ``messages`` (nothing without any)."""
    n = sum(1 for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")
    return f" with {n} image{'s' if n != 1 else ''}" if n else ""


def _args_text(arguments) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def _speculative(session) -> bool:
    """Whether ``session`` decodes speculatively (its stats lines then show the drafted / accepted counts)."""
    return getattr(session, "drafter", None) is not None


def _stats_line(st, speculative: bool = False) -> str:
    """The stats line after a reply (``st``: ``TurnStats``); ``speculative``: with the drafted / accepted counts."""
    return (
        f"[prompt {st.prompt_tokens} tok ({st.prefill_tokens} prefilled) {st.prompt_tps:.1f} tok/s | "
        f"generation {st.generation_tokens} tok {st.generation_tps:.1f} tok/s | "
        f"peak memory {st.peak_memory_gb:.3f} GB | {st.finish_reason}"
        + (f" | {draft_text(st.drafted_tokens, st.accepted_tokens)}]" if speculative else "]")
    )


def run(args: argparse.Namespace) -> int:
    return ranks.run_command(args, lambda: check_draft_args(args), lambda group: _run(args, group))


def _run(args: argparse.Namespace, group) -> int:
    from ..chat.session import ChatSession
    from ..parallel.health import RankError
    from ..prompt_cache import PromptCacheError

    try:
        tools = _read_tools(args.tools) if args.tools else None
        model, tokenizer = load_from_args(args)
        draft = draft_from_args(args, tokenizer, group)
        sampling = sampling_from_args(args)
        session = ChatSession(
            model, tokenizer, system=args.system, tools=tools, thinking=args.think, thinking_effort=args.effort,
            chat_format=args.chat_format, max_tokens=args.max_tokens, max_kv_size=args.max_kv_size,
            max_checkpoints=args.max_checkpoints, sampling=sampling, **kv_from_args(args), draft=draft,
            num_draft_tokens=args.num_draft_tokens,
        )
        if args.load:
            with ranks.together(group, f"loading {args.load}"):
                saved = session.read_saved(ranks.rank_path(args.load, group))
            session.restore(saved)
    except RankError:  # rank 0 printed it; every rank ends with it
        return 2
    except (OSError, ValueError, PromptCacheError) as e:
        return ranks.report_error(e, group)
    print(f"kimi-mlx chat: {args.model} ({session.chat_format} format). /help for commands, Ctrl-D or /exit quits.")
    try:
        Repl(session, args.hide_reasoning, out=sys.stdout, group=group).loop()
    except KeyboardInterrupt:
        if not ranks.is_parallel(group):
            raise
        if group.rank() == 0:  # Ctrl-C ends a --parallel chat on every rank
            print("\n[interrupted: Ctrl-C ends a --parallel chat]", file=sys.stderr)
        return 130
    return 0
