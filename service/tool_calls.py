"""Tool calling for /v1/chat/completions: `tools` + `tool_choice` -> the prompt, a grammar, and the
answer's `message.tool_calls` (or `delta.tool_calls` chunks when streamed).

`tool_choice` "none" hides the tools; "auto" shows them and parses Hermes-style calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of the default model's
family) out of free text; "required" and a named function constrain the output with a grammar
(a JSON list of calls, or the function's arguments), so the model can only answer with valid
calls. A chat template that knows tools gets them as `tools=`; one that does not (SmolLM2's)
gets Hermes' instructions in the system message, and earlier calls and tool results as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.params import StructuredOutputsParams

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_OPEN = "<tool_call>"
_HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools> {tools} </tools> For each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>')


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice ask for. mode: auto | required | named."""

    mode: str
    tools: list[dict[str, Any]]  # the `function` objects: name, description, parameters
    name: str | None = None  # the named function

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            params = next(t for t in self.tools if t["name"] == self.name).get("parameters")
            return StructuredOutputsParams(json=params, source="tools") if params \
                else StructuredOutputsParams(json_object=True, source="tools")
        if self.mode == "required":
            calls = [{"type": "object", "properties": {
                "name": {"enum": [t["name"]]},
                "arguments": t.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"]} for t in self.tools]
            return StructuredOutputsParams(json={"type": "array", "minItems": 1,
                                                 "items": {"anyOf": calls}}, source="tools")
        return None


def tool_plan(tools: Any, tool_choice: Any) -> ToolPlan | None:
    """The plan for a request's `tools` / `tool_choice`; None when no tool is in play."""
    functions = _functions(tools)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return None
    if tool_choice in ("auto", "required"):
        if not functions:
            if tool_choice == "auto":
                return None
            raise InvalidRequestError('tool_choice "required" needs tools', "tool_choice")
        return ToolPlan(tool_choice, functions)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) \
        and tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": '
                                  '"function", "function": {"name": ...}}', "tool_choice")
    if name not in {f["name"] for f in functions}:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools",
                                  "tool_choice")
    return ToolPlan("named", functions, name)


def _functions(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise InvalidRequestError(f'tools[{i}] must be {{"type": "function", "function": '
                                      '{"name": ..., "parameters": {...}}}', f"tools.{i}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema "
                                      "object", f"tools.{i}")
        out.append(fn)
    return out


# --------------------------------------------------------------------------- the prompt


def template_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, template: str
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools=) for the chat template. `messages` hold role, content and, from the
    request, tool_calls / tool_call_id. A template that names tool_calls takes them as they
    are; for any other the calls and results become Hermes text."""
    native = "tool_calls" in template or "tools" in template
    out = [_message(m, native) for m in messages]
    if plan is None:
        return out, None
    tools = [{"type": "function", "function": f} for f in plan.tools]
    if native:
        return out, tools
    system = _HERMES_SYSTEM.format(tools=json.dumps(tools, ensure_ascii=False))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _message(m: dict[str, Any], native: bool) -> dict[str, Any]:
    calls = m.get("tool_calls") or []
    base = {"role": m["role"], "content": m.get("content") or ""}
    if native:
        if calls:
            base["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                "name": c["function"]["name"],
                "arguments": _arguments(c["function"].get("arguments"))}} for c in calls]
        if m.get("tool_call_id") is not None:
            base["tool_call_id"] = m["tool_call_id"]
        return base
    if calls:
        text = "\n".join(_OPEN + "\n" + json.dumps(
            {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))},
            ensure_ascii=False) + "\n</tool_call>" for c in calls)
        base["content"] = f"{base['content']}\n{text}".lstrip("\n")
    if m["role"] == "tool":
        base["content"] = f"<tool_response>\n{base['content']}\n</tool_response>"
    return base


def _arguments(value: Any) -> Any:
    """A call's arguments as an object: OpenAI sends them as a JSON string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}


def check_history(messages: list[Any]) -> None:
    """400 for a malformed tool call in an assistant message (each needs a function name)."""
    for i, m in enumerate(messages):
        for call in m.tool_calls or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError("each tool call needs function.name and "
                                          "function.arguments", f"messages.{i}.tool_calls")


# --------------------------------------------------------------------------- the answer


def new_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished choice; text that holds no valid call stays content."""
    if plan.mode == "named":
        return None, [new_call(plan.name or "", text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
            return None, [new_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                          for c in calls]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens: leave it as text
            return text, []
    start = text.find(_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _CALL.findall(text[start:]):
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, TypeError, KeyError):
            return text, []
        calls.append(new_call(name, args if isinstance(args, str)
                              else json.dumps(args, ensure_ascii=False)))
    content = text[:start].strip()
    return content or None, calls


def finish_reason(calls: list[dict[str, Any]], engine_reason: str | None) -> str | None:
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


@dataclass
class ToolCallStream:
    """One streamed choice: named calls stream their arguments as they come; auto streams text
    until a `<tool_call>` may begin; the calls themselves (auto, required) go out at the end."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content (auto)
    call: dict[str, Any] | None = None  # the named call, once announced
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, delta: str) -> dict[str, Any] | None:
        """The delta message fields for new text, or None while it is held back."""
        self.text += delta
        if self.plan.mode == "named":
            if self.call is None:
                self.call = new_call(self.plan.name or "", "")
                return {"tool_calls": [{"index": 0, **self.call,
                                        "function": {"name": self.plan.name, "arguments": delta}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta \
                else None
        if self.plan.mode == "required":
            return None
        safe = _safe_prefix(self.text)
        if safe <= self.sent:
            return None
        out, self.sent = self.text[self.sent:safe], safe
        return {"content": out}

    def finish(self) -> list[dict[str, Any]]:
        """The last delta fields: held-back text, then the calls (auto, required)."""
        if self.plan.mode == "named":
            self.calls = [self.call] if self.call else []
            return []
        _, self.calls = parse_output(self.plan, self.text)
        out: list[dict[str, Any]] = []
        if self.plan.mode == "auto":
            rest = self.text[self.sent:self.text.find(_OPEN) if self.calls else len(self.text)]
        else:
            rest = "" if self.calls else self.text
        if rest:
            out.append({"content": rest})
        if self.calls:
            out.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(self.calls)]})
        return out


def _safe_prefix(text: str) -> int:
    """How much of `text` cannot be part of a tool call: up to `<tool_call>` or a tail that
    could still become one."""
    start = text.find(_OPEN)
    if start >= 0:
        return start
    for k in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)
