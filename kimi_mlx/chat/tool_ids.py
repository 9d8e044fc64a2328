"""Tool-call ids: the chat templates' ids, the ids clients send back, and tool results put back in call order.

Kimi Linear's template (K2-Instruct family) ignores the ids a conversation carries: it names the n-th tool call of
the conversation ``functions.{name}:{n}`` (n counts from 0) and writes each tool result as ``## Return of`` the
oldest call not yet answered, so a result is paired with its call by position alone. Kimi-K3 writes no ids; it
pairs a run of results with the last assistant message's calls by ``tool_call_id`` when every result names one of
them, and by position otherwise. So the ids a client sends back (OpenAI ``tool_call_id``, Anthropic
``tool_use_id``, or the ids the server handed out, which are the model's ``functions.{name}:{n}``) only say which
call each result answers, and a result sent out of call order would be written as the answer to another call.

:func:`in_call_order` (the server applies it to every request) maps each result to the call it names, by the id
the client gave that call or else by the call's template id, and puts every run of results back in call order.
What the templates cannot pair right is refused with a ``ValueError`` naming the ids: a result naming none of the
calls awaiting an answer, a call answered twice, and (``complete=True``, the OpenAI and Anthropic APIs' rule) a
call whose result is missing from the tool messages right after it. A tool result that follows no tool call is
left as it is (the Kimi Linear template names it ``functions.{name}:{n}`` after the message's ``name``).

    calls = tool_call_ids(messages)        # every call: message, position, name, template id, client id
    messages = in_call_order(messages)     # runs of results in call order (ValueError when they cannot be)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCallId", "answer_order", "in_call_order", "tool_call_ids"]


@dataclass(frozen=True)
class ToolCallId:
    """One tool call of a conversation: the assistant message it is in (``message``, an index into the
    conversation), its ``position`` among that message's calls (from 0), the function ``name``, the Kimi Linear
    template's ``template_id`` (``functions.{name}:{n}``, ``n`` counting the conversation's calls from 0) and the
    ``client_id`` the conversation gave it (its ``id``; None when it has none)."""

    message: int
    position: int
    name: str
    template_id: str
    client_id: str | None


def tool_call_ids(messages: Sequence[Mapping[str, Any]]) -> list[ToolCallId]:
    """Every tool call of ``messages`` (OpenAI-style dicts, see :mod:`kimi_mlx.chat.format`), in order."""
    out: list[ToolCallId] = []
    for i, msg in enumerate(messages):
        if not (isinstance(msg, Mapping) and msg.get("role") == "assistant" and msg.get("tool_calls")):
            continue
        for position, call in enumerate(msg["tool_calls"]):
            if not isinstance(call, Mapping):
                raise TypeError(f"message {i}: tool call {position} must be a dict, got {type(call).__name__}")
            fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
            name = str(fn.get("name"))
            client_id = None if call.get("id") is None else str(call["id"])
            out.append(ToolCallId(i, position, name, f"functions.{name}:{len(out)}", client_id))
    return out


def _result_id(result: Mapping[str, Any]) -> str | None:
    rid = result.get("tool_call_id", result.get("id"))
    return None if rid is None else str(rid)


def _names(calls: Sequence[ToolCallId]) -> str:
    if not calls:
        return "it made none"
    return ", ".join(f"{c.client_id!r} ({c.template_id})" if c.client_id else repr(c.template_id) for c in calls)


def _unanswered(calls: Sequence[ToolCallId]) -> ValueError:
    return ValueError(f"the tool call(s) {_names(calls)} have no result: answer every call of an assistant message "
                      "in the tool messages right after it")


def answer_order(calls: Sequence[ToolCallId], results: Sequence[Mapping[str, Any]], *, complete: bool) -> list[int]:
    """Indices into ``results`` (tool messages answering ``calls``, one assistant message's) in call order.

    A result's ``tool_call_id`` (or ``id``) names a call by the id its client gave it, else by its template id; a
    result without one answers the first call not yet answered. ``ValueError`` (naming the ids) for a result that
    names none of the calls awaiting an answer or answers one a second time, and with ``complete`` for a call
    left without a result.
    """
    answered: dict[int, int] = {}  # call position -> result index
    for r, result in enumerate(results):
        rid = _result_id(result)
        waiting = [c for c in calls if c.position not in answered]
        if rid is None:
            match = waiting[:1]
        else:
            match = [c for c in waiting if c.client_id == rid] or [c for c in waiting if c.template_id == rid]
        if match:
            answered[match[0].position] = r
            continue
        if rid is None:
            raise ValueError(f"tool result {r + 1} of {len(results)} answers no call: the assistant message before "
                             f"it made {len(calls)} ({_names(calls)})")
        if any(rid in (c.client_id, c.template_id) for c in calls):
            raise ValueError(f"two tool results answer the tool call {rid!r}")
        raise ValueError(f"tool result for {rid!r} names none of the tool calls of the assistant message before it "
                         f"({_names(calls)})")
    if complete and len(answered) < len(calls):
        raise _unanswered([c for c in calls if c.position not in answered])
    return [answered[c.position] for c in calls if c.position in answered]


def in_call_order(messages: Sequence[Mapping[str, Any]], *, complete: bool = True) -> list[Mapping[str, Any]]:
    """``messages`` with every run of tool messages in the order of the calls it answers (see the module docstring).

    A run answers the calls of the last assistant message before it, unless an earlier run answered them (a run
    that answers no calls is left as it is). With ``complete``, every call must be answered by the run right
    after its message, before the conversation moves on or ends. The messages are not copied or changed, only
    reordered; ``ValueError`` for results the templates cannot pair with their calls.
    """
    calls_of: dict[int, list[ToolCallId]] = {}
    for call in tool_call_ids(messages):
        calls_of.setdefault(call.message, []).append(call)
    out = list(messages)
    awaiting: list[ToolCallId] = []  # calls of the last assistant message, while no run has answered them
    i, n = 0, len(messages)
    while i < n:
        role = messages[i].get("role") if isinstance(messages[i], Mapping) else None
        if role == "tool":
            j = i
            while j < n and isinstance(messages[j], Mapping) and messages[j].get("role") == "tool":
                j += 1
            if awaiting:
                run = out[i:j]
                out[i:j] = [run[k] for k in answer_order(awaiting, run, complete=complete)]
                awaiting = []
            i = j
            continue
        if awaiting and complete:
            raise _unanswered(awaiting)
        if role == "assistant":
            awaiting = calls_of.get(i, [])
        i += 1
    if awaiting and complete:
        raise _unanswered(awaiting)
    return out
