"""The docs site's generated reference pages, each built from the code itself at `make docs` time.

`PAGES` maps a page path under docs/ to the function that writes it; docs/gen/hooks.py adds them
to the mkdocs build, and tests/unit/test_docs.py checks each one against its source."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
HEADER = ("!!! note \"Generated\"\n    This page is generated from {source} each time the site is "
          "built (`make docs`); edit the code, not this page.\n")


def cell(text: Any) -> str:
    """`text` made safe for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: Any) -> str:
    text = str(text)
    tick = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{tick}{pad}{text}{pad}{tick}"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


# ------------------------------------------------------------------------------------------ CLI


@dataclass(frozen=True)
class Command:
    """One command line: how it is called, its parser, and where it comes from."""
    name: str
    parser: argparse.ArgumentParser
    also: str = ""  # another spelling of the same command


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


ALSO = {"serve": "python -m kvserve.service.api_server [--model MODEL]",
        "router": "python -m kvserve.service.router",
        "plan": "python -m kvserve.operator plan (the operator image, no torch)",
        "render": "python -m kvserve.operator render",
        "operator": "python -m kvserve.operator operator"}
# Entry points outside `kvserve COMMAND` that users or the operator's pods run.
MODULE_PARSERS = (("python -m kvserve.operator.fetch", "kvserve.operator.fetch"),
                  ("python -m kvserve.service.sim.fleet", "kvserve.service.sim.fleet"))


def commands() -> list[Command]:
    """Every command line kvserve has: `kvserve` and each subcommand, then module entry points."""
    from kvserve.service.cli import build_parser

    top = build_parser()
    out = [Command("kvserve", top)]
    out += [Command(f"kvserve {name}", sub, ALSO.get(name, ""))
            for name, sub in _subcommands(top).items()]
    for name, module in MODULE_PARSERS:
        out.append(Command(name, importlib.import_module(module).build_parser()))
    return out


def options(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    """(group title, action) for every argument but -h and the subcommand selector."""
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            yield group.title or "", action


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.choices:
        return " \\| ".join(code(c) for c in action.choices)
    kind = getattr(action.type, "__name__", None) if action.type else "str"
    return code(action.metavar or kind or "value")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    switch_off = action.nargs == 0 and action.default is False
    if action.default in (None, argparse.SUPPRESS) or switch_off:
        return ""
    return code(str(action.default) if isinstance(action.default, Path) else action.default)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.help == argparse.SUPPRESS:
        return "(hidden from `--help`)"
    if not action.help:
        return ""
    # The plain formatter: no "(default: ...)" suffix, the default has its own column.
    return cell(argparse.HelpFormatter(parser.prog)._expand_help(action))


def flag_names(action: argparse.Action) -> list[str]:
    return list(action.option_strings) or [action.metavar or action.dest]


def cli_page() -> str:
    lines = ["# Command line", "", HEADER.format(source="the argparse parsers (`kvserve --help` "
             "and each subcommand's)"), "Every command and flag. The same text is in `--help`; "
             "defaults are what the parser sets when a flag is left out.", ""]
    for cmd in commands():
        lines += [f"## {cmd.name} {{#{_anchor(cmd.name)}}}", "",
                  cell(cmd.parser.description or ""), "", "```{ .text .no-copy }",
                  _usage(cmd).rstrip(), "```", ""]
        if cmd.also:
            lines += [f"Also: `{cmd.also}`.", ""]
        subs = _subcommands(cmd.parser)
        if subs:
            lines += table(["command", "what it does"], [
                [f"[`{cmd.name} {n}`](#{_anchor(cmd.name + ' ' + n)})",
                 cell(_sub_help(cmd.parser, n))] for n in subs])
        rows_by_group: dict[str, list[list[str]]] = {}
        for group, action in options(cmd.parser):
            rows_by_group.setdefault(group, []).append([
                ", ".join(code(n) for n in flag_names(action)), _value(action), _default(action),
                _help(cmd.parser, action)])
        for group, rows in rows_by_group.items():
            if group not in ("options", "positional arguments"):
                lines += [f"**{group[0].upper() + group[1:]}**", ""]
            lines += table(["flag", "value", "default", "description"], rows)
    return "\n".join(lines)


def _usage(cmd: Command) -> str:
    """A short usage line: the command, `[options]` (the tables list them), the positionals."""
    words = [cmd.name]
    if any(a.option_strings for _, a in options(cmd.parser)):
        words.append("[options]")
    for action in cmd.parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            words.append("COMMAND ...")
        elif not action.option_strings:
            name = action.metavar or action.dest.upper()
            words.append(f"[{name}]" if action.nargs in ("?", "*") else name)
    return " ".join(words)


def _sub_help(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _anchor(title: str) -> str:
    """A heading's id (set explicitly with attr_list, so links never depend on the slugifier)."""
    return "-".join("".join(c if c.isalnum() else " " for c in title.lower()).split())


# ------------------------------------------------------------------------------------------ CRD


@dataclass(frozen=True)
class Field:
    path: str
    schema: dict[str, Any]
    required: bool


def crd() -> dict[str, Any]:
    """The CRD the chart installs (charts/kvserve/crds/; the tests hold it equal to the code's)."""
    from kvserve.operator.crd import crd_manifest

    return crd_manifest()


def crd_fields(schema: dict[str, Any], prefix: str) -> Iterator[Field]:
    """Every property under `schema`, depth first; list items appear as `path[]`."""
    required = set(schema.get("required", []))
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        yield Field(path, sub, name in required)
        yield from crd_fields(sub, path)
        items = sub.get("items") or {}
        if items.get("properties"):
            yield from crd_fields(items, path + "[]")


def _type(schema: dict[str, Any]) -> str:
    kind = schema.get("type", "any")
    if schema.get("x-kubernetes-int-or-string"):
        kind = "int or string"
    if kind == "array":
        kind = f"array of {(schema.get('items') or {}).get('type', 'any')}"
    if schema.get("x-kubernetes-preserve-unknown-fields") and not schema.get("properties"):
        kind += " (free-form)"
    return kind


def _constraints(schema: dict[str, Any]) -> str:
    parts = []
    if "enum" in schema:
        parts.append("one of " + ", ".join(code(v) for v in schema["enum"]))
    for key, word in (("minimum", ">="), ("maximum", "<="), ("minLength", "length >="),
                      ("minItems", "items >="), ("maxItems", "items <=")):
        if key in schema:
            parts.append(f"{word} {schema[key]}")
    if "pattern" in schema:
        parts.append("matches " + code(schema["pattern"]))
    for rule in schema.get("x-kubernetes-validations", []):
        parts.append(cell(rule.get("message") or rule["rule"]))
    return "; ".join(parts)


def crd_page() -> str:
    manifest = crd()
    spec = manifest["spec"]
    version = spec["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    names = spec["names"]
    lines = ["# KVInferenceService", "", HEADER.format(source="the CRD the operator installs "
             "(`operator/crd.py`, written to `charts/kvserve/crds/` and `manifests/crd.yaml`)"),
             f"`apiVersion: {spec['group']}/{version['name']}`, `kind: {names['kind']}`, "
             f"short name{'s' if len(names.get('shortNames', [])) > 1 else ''} "
             + ", ".join(code(s) for s in names.get("shortNames", [])) + f", scope "
             f"{spec['scope']}. {cell(root.get('description', ''))}", "",
             "## `kubectl get kvis` columns", ""]
    lines += table(["column", "type", "JSONPath"], [
        [c["name"].upper(), c["type"], code(c["jsonPath"])]
        for c in version.get("additionalPrinterColumns", [])])
    scale = version.get("subresources", {}).get("scale")
    if scale:
        lines += ["The scale subresource maps `kubectl scale` and the HPA to "
                  f"`{scale['specReplicasPath']}`.", ""]
    for part in ("spec", "status"):
        schema = root["properties"][part]
        lines += [f"## `{part}`", "", cell(schema.get("description", "")), ""]
        rows = [[code(f"{part}.{f.path}"), cell(_type(f.schema)) + (" (required)" if f.required
                 else ""), code(json.dumps(f.schema["default"])) if "default" in f.schema else "",
                 cell(f.schema.get("description", "")) + (
                     f" ({_constraints(f.schema)})" if _constraints(f.schema) else "")]
                for f in crd_fields(schema, "")]
        lines += table(["field", "type", "default", "description"], rows)
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class Metric:
    component: str
    name: str
    kind: str
    help: str
    labels: tuple[str, ...]


def registries() -> list[tuple[str, Any]]:
    """(component, prometheus registry) of every process that serves /metrics."""
    from kvserve.service.router.metrics import RouterMetrics
    from kvserve.service.server.metrics import ServerMetrics

    return [("replica (`kvserve serve`)", ServerMetrics("MODEL").registry),
            ("router (`kvserve router`)", RouterMetrics().registry)]


def metrics() -> list[Metric]:
    out = []
    for component, registry in registries():
        labels = {}
        for collector in list(registry._collector_to_names):
            for name in registry._collector_to_names[collector]:
                labels[name] = tuple(getattr(collector, "_labelnames", ()))
        for family in registry.collect():
            out.append(Metric(component, family.name, family.type, family.documentation,
                              labels.get(family.name, labels.get(family.name + "_total", ()))))
    return out


def exposed_name(metric: Metric) -> str:
    """The name a scrape shows: counters gain `_total` (histograms' suffixes are in the intro)."""
    return metric.name + "_total" if metric.kind == "counter" else metric.name


def metrics_page() -> str:
    lines = ["# Prometheus metrics", "", HEADER.format(source="the servers' Prometheus registries "
             "(`service/server/metrics.py`, `service/router/metrics.py`)"),
             "Replicas keep vLLM's names (`vllm:*`, so dashboards built for vLLM read them) and "
             "add `kvserve:*`; the router's are `kvserve_router:*`. Every replica metric carries "
             "the label `model_name`. Counters are scraped as `NAME_total`, histograms as "
             "`NAME_bucket`, `NAME_sum` and `NAME_count`.", ""]
    by_component: dict[str, list[Metric]] = {}
    for m in metrics():
        by_component.setdefault(m.component, []).append(m)
    for component, items in by_component.items():
        lines += [f"## {component[0].upper() + component[1:]}", ""]
        lines += table(["metric", "type", "labels", "help"], [
            [code(exposed_name(m)), m.kind, ", ".join(code(x) for x in m.labels), cell(m.help)]
            for m in items])
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- HTTP API


def openapi() -> dict[str, Any]:
    from kvserve.service.server.app import openapi_document

    return openapi_document()


def operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            yield path, method.upper(), op


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " or ".join(_schema_type(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return " \\| ".join(json.dumps(v) for v in schema["enum"])
    return schema.get("type", "any")


def _body_model(op: dict[str, Any]) -> str | None:
    ref = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
           .get("schema", {}).get("$ref"))
    return ref.rsplit("/", 1)[-1] if ref else None


def unsupported_fields() -> dict[str, set[str]]:
    """path -> request fields the server knows but refuses (a 400 unless they ask for nothing)."""
    from kvserve.service.server.app import REQUEST_BODIES

    return {path: set(getattr(model, "UNSUPPORTED", {})) for path, model in REQUEST_BODIES.items()}


def http_page() -> str:
    doc = openapi()
    refused = unsupported_fields()
    schemas = doc.get("components", {}).get("schemas", {})
    lines = ["# HTTP API", "", HEADER.format(source="the server's OpenAPI document "
             "(`service/server/app.py`; a running server serves it at `/openapi.json`)"),
             "One replica (`kvserve serve`) answers these. The router (`kvserve router`) "
             "answers `/health`, `/metrics` (its own) and `/v1/models` itself and forwards the "
             "rest to a replica. Errors have OpenAI's shape: `{\"error\": {\"message\", "
             "\"type\", \"param\", \"code\"}}`.", ""]
    lines += table(["method", "path", "what it does"], [
        [m, f"[`{p}`](#{_anchor(m + ' ' + p)})", cell(op.get("summary", ""))]
        for p, m, op in operations(doc)])
    for path, method, op in operations(doc):
        lines += [f"## {method} {path} {{#{_anchor(method + ' ' + path)}}}", ""]
        if op.get("description"):
            lines += [cell(op["description"]), ""]
        model = _body_model(op)
        if model:
            body = schemas[model]
            required = set(body.get("required", []))
            lines += [f"Request body: JSON, `{model}`.", ""]
            lines += table(["field", "type", "default", "notes"], [
                [code(name) + (" (required)" if name in required else ""),
                 cell(_schema_type(s)), code(json.dumps(s["default"])) if "default" in s else "",
                 "not supported: a 400 unless it asks for nothing" if name in refused.get(path, ())
                 else cell(s.get("description", ""))]
                for name, s in body.get("properties", {}).items()])
        codes = ", ".join(f"`{c}` {cell(r.get('description', ''))}"
                          for c, r in op.get("responses", {}).items())
        lines += [f"Responses: {codes}.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ vLLM comparison

COMPAT = Path(__file__).with_name("vllm_compat.yaml")


def compat_rows() -> dict[str, list[dict[str, str]]]:
    """Each entry of vllm_compat.yaml with its status: `implemented` when kvserve has the name
    (a `kvserve serve` flag, an `LLM(...)` / `SamplingParams` argument, a server route), unless
    the file says `different` (with a note); otherwise what the file says, or `missing`."""
    data = yaml.safe_load(COMPAT.read_text())
    have = kvserve_names()
    out: dict[str, list[dict[str, str]]] = {}
    for section, entries in data.items():
        if section == "source":
            continue
        rows = []
        for entry in entries:
            name, note = entry["name"], entry.get("note", "")
            present = resolves(name) if section == "python_api" else name in have[section]
            status = entry.get("status") or ("implemented" if present else "missing")
            if status == "implemented" and not present:
                raise ValueError(f"vllm_compat.yaml: {name} is marked implemented, but kvserve "
                                 f"has no {section} of that name")
            rows.append({"name": name, "status": status, "note": note})
        out[section] = rows
    return out


def resolves(vllm_path: str) -> bool:
    """Whether vLLM's dotted path (`vllm.` read as `kvserve.`) names something in kvserve."""
    parts = ("kvserve" + vllm_path.removeprefix("vllm")).split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def kvserve_names() -> dict[str, set[str]]:
    import inspect
    from dataclasses import fields

    from kvserve import LLM, SamplingParams
    from kvserve.service.cli import build_serve_parser

    flags = {n for _, a in options(build_serve_parser()) for n in a.option_strings}
    # LLM(...) passes its **kwargs to EngineConfig, after taking vLLM's structured-output aliases.
    llm_module = importlib.import_module(LLM.__module__)
    llm = set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    llm |= {f.name for f in fields(llm_module.EngineConfig)}
    llm_source = inspect.getsource(llm_module)
    llm |= {name for name in ("structured_outputs_config", "guided_decoding_backend")
            if f'kwargs.pop("{name}"' in llm_source}
    if "split_vllm_kwargs(kwargs)" in llm_source:  # vLLM arguments with no effect here
        llm |= set(importlib.import_module("kvserve.engine.arg_utils").NO_EFFECT)
    sampling = set(inspect.signature(SamplingParams).parameters)
    routes = {f"{m} {p}" for p, m, _ in operations(openapi())}
    python = {e["name"] for e in yaml.safe_load(COMPAT.read_text()).get("python_api", [])
              if resolves(e["name"])}
    return {"serve_flags": flags, "llm_args": llm, "sampling_params": sampling, "routes": routes,
            "python_api": python}


SECTION_TITLES = {"serve_flags": "`vllm serve` flags", "llm_args": "`LLM(...)` arguments",
                  "sampling_params": "`SamplingParams` fields", "routes": "HTTP routes",
                  "python_api": "Python names (vLLM's import paths)"}
BADGE = {"implemented": "implemented", "different": "different", "missing": "missing",
         "not applicable": "not applicable"}


def vllm_page() -> str:
    data = yaml.safe_load(COMPAT.read_text())
    rows = compat_rows()
    lines = ["# vLLM compatibility", "", HEADER.format(source="`docs/gen/vllm_compat.yaml` (the "
             "vLLM names, from vLLM's docs) checked against kvserve's own parsers, signatures "
             "and routes"), cell(data.get("source", "")), "",
             "**implemented**: kvserve has the name and it means what it means in vLLM. "
             "**different**: kvserve has it, with the difference in the note. **missing**: "
             "not in kvserve. **not applicable**: a vLLM feature kvserve does not aim at.", ""]
    counts = {s: {k: sum(r["status"] == k for r in v) for k in BADGE} for s, v in rows.items()}
    lines += table(["", *BADGE], [[SECTION_TITLES[s], *(str(counts[s][k]) for k in BADGE)]
                                  for s in rows])
    for section, entries in rows.items():
        lines += [f"## {SECTION_TITLES[section]}", ""]
        lines += table(["vLLM", "kvserve", "note"], [
            [code(r["name"]), f"**{r['status']}**" if r["status"] == "implemented"
             else r["status"], cell(r["note"])] for r in entries])
    lines += examples_section()
    vllm_flags = {r["name"] for r in rows.get("serve_flags", [])}
    own = sorted(kvserve_names()["serve_flags"] - vllm_flags - {"-h", "--help"})
    lines += ["## `kvserve serve` flags vLLM does not have", "",
              ", ".join(f"[{code(f)}](cli.md#kvserve-serve)" for f in own), ""]
    return "\n".join(lines)


EXAMPLES = Path(__file__).with_name("vllm_examples.yaml")
EXAMPLE_STATUSES = ("runs", "needs a larger model", "missing", "not applicable")
UPSTREAM = "https://github.com/vllm-project/vllm/blob/main/examples"


def example_rows() -> dict[str, list[dict[str, str]]]:
    """vllm_examples.yaml, checked: a `runs` entry's script exists under examples/vllm/ (the
    test runs each), every other entry says why in its note."""
    data = yaml.safe_load(EXAMPLES.read_text())
    for kind, entries in data.items():
        for e in entries:
            if e["status"] not in EXAMPLE_STATUSES:
                raise ValueError(f"vllm_examples.yaml: {e['name']}: unknown status {e['status']}")
            copy = ROOT / "tests" / "vllm_examples" / e["name"] if kind == "current" \
                else ROOT / "examples" / "vllm" / e.get("script", "")
            if e["status"] == "runs" and not copy.is_file():
                raise ValueError(f"vllm_examples.yaml: {e['name']} runs, but "
                                 f"{copy.relative_to(ROOT)} does not exist")
            if e["status"] != "runs" and not e.get("note"):
                raise ValueError(f"vllm_examples.yaml: {e['name']}: say why it does not run")
    return data


def examples_section() -> list[str]:
    data = example_rows()
    current = data.pop("current", [])
    entries = [e for kind in data.values() for e in kind]
    ran = sum(e["status"] == "runs" for e in entries)
    ours = sum(e["status"] in ("runs", "needs a larger model") for e in entries)
    counts = ", ".join(f"{sum(e['status'] == k for e in entries)} {k}" for k in EXAMPLE_STATUSES)
    lines = ["## vLLM's examples", "",
             f"**{ran} of {ours}** of vLLM's documented examples for features kvserve has run "
             f"unchanged but for the import, the model and the URL ({len(entries)} listed: "
             f"{counts}). Each runnable one is kept in `examples/vllm/` and run by "
             "`tests/integration/test_vllm_examples.py` (offline ones in-process, online ones "
             "against one `kvserve serve`); the list is `docs/gen/vllm_examples.yaml`.", ""]
    folders = {"offline": "offline_inference", "online": "online_serving"}
    for kind, rows in data.items():
        lines += [f"### {folders[kind]}", ""]
        lines += table(["vLLM example", "status", "kvserve's copy", "note"], [
            [f"[{code(e['name'])}]({UPSTREAM}/{folders[kind]}/{e['name']})",
             f"**{e['status']}**" if e["status"] == "runs" else e["status"],
             code("examples/vllm/" + e["script"]) if e.get("script") else "",
             cell(e.get("note", ""))] for e in rows])
    return lines + current_examples_section(current)


def current_examples_section(rows: list[dict[str, Any]]) -> list[str]:
    """The `current` list: vLLM's examples in its current layout, copied as they are."""
    ran = sum(e["status"] == "runs" for e in rows)
    fits = sum(e["status"] in ("runs", "missing") for e in rows)
    lines = ["### vLLM's current examples, copied as they are", "",
             f"**{ran} of {fits}** of the scripts below that fit the default model run as vLLM "
             f"ships them ({ran} of {len(rows)} listed; checked 2026-12-07): "
             "`tests/vllm_examples/` holds each with only `vllm` -> `kvserve` in its imports and "
             "the model changed, and `tests/integration/test_vllm_examples_verbatim.py` runs each "
             "as its own process on the default model (online ones against one `kvserve serve`).",
             ""]
    lines += table(["vLLM example", "status", "note"], [
        [f"[{code(e['name'])}]({UPSTREAM}/{e['name']})",
         f"**{e['status']}**" if e["status"] == "runs" else e["status"],
         cell(e.get("note", ""))] for e in rows])
    return lines


PATHS = Path(__file__).with_name("vllm_paths.yaml")


def vllm_paths_page() -> str:
    """vllm_paths.yaml as a table: the vLLM path a script imports, the kvserve object it gets."""
    rows = yaml.safe_load(PATHS.read_text())["paths"]
    lines = ["# vLLM's module paths", "", HEADER.format(source="`docs/gen/vllm_paths.yaml` (every "
             "row imported by `tests/unit/test_vllm_paths.py`)"),
             "A vLLM script runs on kvserve with `vllm` changed to `kvserve` in its imports: each "
             "path below resolves to the kvserve object on its right, which is defined once (the "
             "paths outside kvserve's own folders are thin re-exports in `vllm_paths/`).", ""]
    lines += table(["vLLM path", "kvserve object", "note"], [
        [code(r["vllm"]), code(r["kvserve"]), cell(r.get("note", ""))] for r in rows])
    return "\n".join(lines)


PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/crd.md": crd_page,
    "reference/metrics.md": metrics_page,
    "reference/http-api.md": http_page,
    "reference/vllm-compat.md": vllm_page,
    "reference/vllm-paths.md": vllm_paths_page,
}
