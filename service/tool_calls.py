"""Tool calling for /v1/chat/completions: `tools` + `tool_choice` -> the prompt, a grammar, and the
answer's `message.tool_calls` (or `delta.tool_calls` chunks when streamed).

`tool_choice` "none" hides the tools; "auto" shows them and parses calls out of free text in the
format of `--tool-call-parser` (service/tool_parsers/; hermes by default, the format of the
default model's family); "required" and a named function constrain the output with a grammar
(a JSON list of calls, or the function's arguments), so the model can only answer with valid
calls. A chat template that knows tools gets them as `tools=`; one that does not (SmolLM2's)
gets the format's instructions in the system message, and earlier calls and tool results as
text. Streamed, each call goes out as soon as its JSON object closes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.params import StructuredOutputsParams
from kvserve.service.tool_parsers import (DEFAULT_TOOL_PARSER, TOOL_PARSERS, ObjectScanner,
                                          ToolParser, call_of)


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice ask for. mode: auto | required | named."""

    mode: str
    tools: list[dict[str, Any]]  # the `function` objects: name, description, parameters
    name: str | None = None  # the named function
    parser: str = DEFAULT_TOOL_PARSER  # --tool-call-parser: how auto calls read in free text

    @property
    def format(self) -> ToolParser:
        return TOOL_PARSERS[self.parser]

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


def tool_plan(tools: Any, tool_choice: Any, parser: str = DEFAULT_TOOL_PARSER
              ) -> ToolPlan | None:
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
        return ToolPlan(tool_choice, functions, parser=parser)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) \
        and tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": '
                                  '"function", "function": {"name": ...}}', "tool_choice")
    if name not in {f["name"] for f in functions}:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools",
                                  "tool_choice")
    return ToolPlan("named", functions, name, parser)


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


def template_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, template: str,
                      parser_name: str = DEFAULT_TOOL_PARSER
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools=) for the chat template. `messages` hold role, content and, from the
    request, tool_calls / tool_call_id. A template that names tool_calls takes them as they
    are; for any other the calls and results become text in the format of the plan's parser
    (without tools in the request: `parser_name`, the server's --tool-call-parser)."""
    native = "tool_calls" in template or "tools" in template
    parser = plan.format if plan is not None else TOOL_PARSERS[parser_name]
    out = [_message(m, native, parser) for m in messages]
    if plan is None:
        return out, None
    tools = [{"type": "function", "function": f} for f in plan.tools]
    if native:
        return out, tools
    system = parser.system.format(tools=json.dumps(tools, ensure_ascii=False))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _message(m: dict[str, Any], native: bool, parser: ToolParser) -> dict[str, Any]:
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
        text = parser.render([(c["function"]["name"], _arguments(c["function"].get("arguments")))
                              for c in calls])
        base["content"] = f"{base['content']}\n{text}".lstrip("\n")
    if m["role"] == "tool":
        base["content"] = parser.tool_result(base["content"])
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
    start = 0 if plan.mode == "required" else plan.format.start(text)
    if start < 0:
        return text, []
    found = [call_of(obj) for obj in ObjectScanner(pos=start).scan(text)]
    if not found or None in found:  # cut short, or not a call: leave it all as text
        return text, []
    calls = [_as_call(c) for c in found if c is not None]
    content = text[:start].strip()
    return content or None, calls


def _as_call(call: tuple[str, Any]) -> dict[str, Any]:
    name, args = call
    return new_call(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def finish_reason(calls: list[dict[str, Any]], engine_reason: str | None) -> str | None:
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


@dataclass
class ToolCallStream:
    """One streamed choice: named calls stream their arguments as they come; auto streams text
    until a call may begin, then (auto, required) sends each call as soon as its JSON closes."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of `text` already sent as content (auto)
    call: dict[str, Any] | None = None  # the named call, once announced
    calls: list[dict[str, Any]] = field(default_factory=list)
    start: int = -1  # where the calls begin in `text` (auto, required), once known
    scanner: ObjectScanner | None = None
    broken: bool = False  # an object that is no call: the rest is held back as text

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
        if self.start < 0:
            self.start = 0 if self.plan.mode == "required" else self.plan.format.start(self.text)
            if self.start >= 0:
                self.scanner = ObjectScanner(pos=self.start)
                out = self.text[self.sent:self.start].rstrip()
                self.sent = self.start
                calls = self._new_calls()
                return {"content": out, **calls} if out else (calls or None)
            # trailing whitespace waits too: before a call it is cut, as in the whole answer
            safe = len(self.text[:self.plan.format.safe_prefix(self.text)].rstrip())
            if safe <= self.sent:
                return None
            out, self.sent = self.text[self.sent:safe], safe
            return {"content": out}
        return self._new_calls() or None

    def _new_calls(self) -> dict[str, Any]:
        if self.scanner is None or self.broken:
            return {}
        new = []
        for obj in self.scanner.scan(self.text):
            call = call_of(obj)
            if call is None:
                self.broken = True
                break
            new.append(_as_call(call))
        first = len(self.calls)
        self.calls += new
        return {"tool_calls": [{"index": first + i, **c} for i, c in enumerate(new)]} if new \
            else {}

    def finish(self) -> list[dict[str, Any]]:
        """The last delta fields: held-back text when no call came (auto, required)."""
        if self.plan.mode == "named":
            self.calls = [self.call] if self.call else []
            return []
        if self.calls:
            return []
        rest = self.text[self.sent:]
        return [{"content": rest}] if rest else []
