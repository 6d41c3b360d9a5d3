"""The docs site: `mkdocs build --strict` passes (no page outside the nav, no broken link or
anchor), and each generated reference page lists exactly what the code has: every CLI flag, CRD
field, Prometheus metric and HTTP route, checked against the sources enumerated independently
(the code's own syntax tree, the installed CRD file, a live server's OpenAPI document). The README
and the quickstarts show the printer columns and the sizing the code really produces."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CODE_DIRS = ("engine", "kernels", "service", "operator")
MKDOCS_ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


@pytest.fixture(scope="module")
def ref() -> Any:
    """docs/gen/reference.py, as the mkdocs hook loads it."""
    spec = importlib.util.spec_from_file_location("kvserve_docs_reference",
                                                  DOCS / "gen" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(config), "-d", str(site)], capture_output=True, text=True,
                          env=MKDOCS_ENV, cwd=config.parent, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


# ------------------------------------------------------------------------------- the build


def test_strict_build_has_every_page_and_the_generated_references(site, ref):
    for uri in ref.PAGES:
        html = (site / uri.replace(".md", "") / "index.html").read_text()
        assert "Generated" in html, uri
    for page in DOCS.rglob("*.md"):
        rel = page.relative_to(DOCS)
        if rel.parts[0] == "gen":
            continue
        name = "" if rel.stem == "index" else rel.stem
        assert (site / rel.parent / name / "index.html").exists(), rel
    assert (site / "perf" / "plots" / "fleet.png").exists()  # bench/results/ plots are published


def _tiny_project(tmp_path: Path, pages: dict[str, str], nav: list[str]) -> Path:
    """A throwaway mkdocs project with this repository's `validation` settings."""
    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir(parents=True)
    for name, text in pages.items():
        (tmp_path / "docs" / name).write_text(text)
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "t", "nav": nav,
                                      "validation": ours["validation"]}))
    return config


@pytest.mark.parametrize("case", ["orphan page", "broken link", "broken anchor"])
def test_strict_build_refuses_orphans_and_broken_links(tmp_path, case):
    pages = {"index.md": "# Home\n\n## Part\n", "other.md": "# Other\n"}
    nav = ["index.md", "other.md"]
    if case == "orphan page":
        nav = ["index.md"]
    elif case == "broken link":
        pages["other.md"] += "\n[gone](missing.md)\n"
    else:
        pages["other.md"] += "\n[gone](index.md#no-such-heading)\n"
    good = _tiny_project(tmp_path / "good", {"index.md": "# Home\n\n## Part\n",
                                             "other.md": "# Other\n[ok](index.md#part)\n"},
                         ["index.md", "other.md"])
    assert mkdocs_build(good, tmp_path / "good-site").returncode == 0
    bad = _tiny_project(tmp_path / "bad", pages, nav)
    result = mkdocs_build(bad, tmp_path / "bad-site")
    assert result.returncode != 0, f"{case} was accepted"


# ------------------------------------------------------------------------------------- CLI


def _code_calls(name: str) -> Iterator[ast.Call]:
    """Every call of `<anything>.name(...)` or `name(...)` in the package's code."""
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call):
                    func = node.func
                    called = func.attr if isinstance(func, ast.Attribute) else getattr(
                        func, "id", None)
                    if called == name:
                        yield node


def flags_in_code() -> set[str]:
    """Every option string written literally in an add_argument(...) call."""
    return {arg.value for call in _code_calls("add_argument") for arg in call.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            and arg.value.startswith("-")}


def documented_sections(page: str) -> dict[str, str]:
    """`## title {#id}` -> the text under it."""
    parts = re.split(r"^## (.+?) \{#[^}]+\}$", page, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def table_first_cells(text: str) -> list[str]:
    return [line.split("|")[1] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| flag")]


def test_every_flag_in_the_code_is_in_the_cli_reference(ref):
    page = ref.cli_page()
    missing = sorted(f for f in flags_in_code() if f"`{f}`" not in page)
    assert not missing, f"flags missing from the CLI reference: {missing}"
    assert len(flags_in_code()) > 80  # the scan sees the serve, router and plan flags


def test_every_subcommand_and_parser_option_has_an_entry(ref):
    from kvserve.service.cli import build_parser

    sections = documented_sections(ref.cli_page())
    top = build_parser()
    listed = re.findall(r"^    (\S+)", top.format_help().split("positional arguments:")[1]
                        .split("options:")[0], flags=re.M)
    for sub in listed:
        assert f"kvserve {sub}" in sections, f"`kvserve {sub}` (in --help) has no section"
    for cmd in ref.commands():
        text = sections[cmd.name]
        for action in cmd.parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, f"{cmd.name} {option} not documented"


def test_every_documented_flag_is_accepted_by_its_command(ref):
    by_name = {cmd.name: cmd.parser for cmd in ref.commands()}
    for name, text in documented_sections(ref.cli_page()).items():
        parser = by_name[name]
        for first in table_first_cells(text):
            for flag in re.findall(r"`(-[^`]+)`", first):
                assert flag in parser._option_string_actions, f"{name}: {flag} does not exist"


@pytest.mark.parametrize("command", ["kvserve serve", "kvserve router"])
def test_every_serve_and_router_flag_says_what_it_does(ref, command):
    text = documented_sections(ref.cli_page())[command]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) > 20
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    assert all(len(c) == 4 for c in cells)
    silent = [c[0] for c in cells if not c[3]]
    assert not silent, f"{command}: flags without a description: {silent}"


# ------------------------------------------------------------------------------------- CRD


def crd_file_paths() -> set[str]:
    """Every spec./status. field path in the CRD file the chart installs, walked here."""
    crd = yaml.safe_load((ROOT / "charts/kvserve/crds/kvinferenceservices.kvserve.io.yaml")
                         .read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    paths: set[str] = set()

    def walk(schema: dict, prefix: str) -> None:
        for name, sub in schema.get("properties", {}).items():
            paths.add(f"{prefix}.{name}")
            walk(sub, f"{prefix}.{name}")
            walk(sub.get("items", {}), f"{prefix}.{name}[]")

    walk(root["spec"], "spec")
    walk(root["status"], "status")
    return paths


def test_every_crd_field_is_documented_and_nothing_else(ref):
    page = ref.crd_page()
    fields = crd_file_paths()
    assert len(fields) > 100 and "spec.engine.kvOffloading.hostGiB" in fields
    missing = sorted(f for f in fields if f"`{f}`" not in page)
    assert not missing, f"CRD fields missing from the reference: {missing}"
    documented = set(re.findall(r"^\| `((?:spec|status)\.[^`]+)`", page, flags=re.M))
    assert documented == fields


def test_crd_reference_shows_defaults_and_printer_columns(ref):
    page = ref.crd_page()
    assert re.search(r"^\| `spec\.engine\.blockSize` \| integer \| `16` \|", page, flags=re.M)
    crd = yaml.safe_load((ROOT / "manifests/crd.yaml").read_text())
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        assert f"| {column['name'].upper()} |" in page


def printer_header() -> str:
    crd = yaml.safe_load((ROOT / "manifests/crd.yaml").read_text())
    return "NAME " + " ".join(c["name"].upper()
                              for c in crd["spec"]["versions"][0]["additionalPrinterColumns"])


@pytest.mark.parametrize("doc", ["README.md", "docs/index.md",
                                 "docs/guides/quickstart-kubernetes.md"])
def test_kubectl_get_kvis_output_matches_the_crd_and_the_sizing(doc):
    """The example output's header is the CRD's printer columns, and its numbers are what the
    operator's sizing gives the example manifest."""
    from kvserve.operator.sizing import plan
    from kvserve.operator.spec import parse_spec

    text = (ROOT / doc).read_text()
    header, row = re.search(r"^(NAME +READY.*)\n(\S+ .*)$", text, flags=re.M).groups()
    assert " ".join(header.split()) == printer_header()
    name, ready, replicas, gpus, concurrency, _age = row.split()
    manifest = next(m for path in sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
                    for m in yaml.safe_load_all(path.read_text())
                    if m and m["metadata"]["name"] == name)
    sizing = plan(parse_spec(manifest)).as_status()
    assert (int(gpus), int(concurrency)) == (sizing["gpusPerReplica"], sizing["maxConcurrency"])
    assert ready == "True" and int(replicas) == manifest["spec"]["replicas"]


def test_quickstart_plan_output_is_what_kvserve_plan_prints(capsys):
    from kvserve.service.cli import main

    text = (DOCS / "guides" / "quickstart-kubernetes.md").read_text()
    command, shown = re.search(r"^kvserve plan (.+)\n```\n\n```\{ \.text \.no-copy \}\n(.*?)\n```",
                               text, flags=re.M | re.S).groups()
    assert main(["plan", *command.split()]) == 0
    assert capsys.readouterr().out.rstrip() == shown


def test_readme_is_a_short_front_door_whose_links_and_paths_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 120
    first_screen = "\n".join(text.splitlines()[:40])
    assert "helm install" in first_screen and "kubectl get kvis" in first_screen
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (ROOT / link).exists(), link
    for path in re.findall(r"(?:manifests|charts|examples)/[\w./-]+\.(?:yaml|py)", text):
        assert (ROOT / path).exists(), path
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    for target in re.findall(r"make ([\w-]+)", text):
        assert target in targets, f"make {target}"


# --------------------------------------------------------------------------------- metrics

METRIC_NAME = re.compile(r"^(vllm|kvserve|kvserve_router):[a-z_]+$")


def metrics_in_code() -> set[str]:
    """Every string literal that names a metric as the first argument of a call."""
    names = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and node.args:
                    arg = node.args[0]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                            and METRIC_NAME.match(arg.value):
                        names.add(arg.value)
    return names


def test_every_metric_in_the_code_is_documented_and_nothing_else(ref):
    page = ref.metrics_page()
    code = metrics_in_code()
    assert {"vllm:gpu_cache_usage_perc", "kvserve_router:redis_up"} <= code
    missing = sorted(m for m in code if not re.search(rf"`{re.escape(m)}(_total)?`", page))
    assert not missing, f"metrics missing from the reference: {missing}"
    documented = {re.sub(r"_total$", "", m) for m in
                  re.findall(r"^\| `([a-z_]+:[a-z_]+)`", page, flags=re.M)}
    assert documented == code


def test_metric_types_and_help_come_from_the_registry(ref):
    page = ref.metrics_page()
    assert re.search(r"^\| `vllm:num_preemptions_total` \| counter \| `model_name` \| "
                     r"Preemptions since start\. \|", page, flags=re.M)
    assert re.search(r"^\| `vllm:time_to_first_token_seconds` \| histogram \| `model_name` \| "
                     r"Time to first token\. \|", page, flags=re.M)


# -------------------------------------------------------------------------------- HTTP API


def test_http_reference_matches_a_live_servers_openapi(ref, tiny_model_dir, monkeypatch):
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.service.server.app import create_app
    from kvserve.service.server.config import ServerConfig

    # every route documented: the runtime LoRA ones exist with LoRA and vLLM's switch on
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=64,
                                                kv_cache_memory=1 << 20, dtype="float32",
                                                attention_backend="torch", enable_lora=True))
    try:
        live = create_app(engine, ServerConfig()).openapi()
    finally:
        engine.shutdown()
    page = ref.http_page()
    documented = set(re.findall(r"^## (GET|POST|PUT|DELETE) (\S+) \{#", page, flags=re.M))
    assert documented == {(m.upper(), p) for p, item in live["paths"].items() for m in item}
    body = live["components"]["schemas"]["CompletionRequest"]["properties"]
    section = page.split("## POST /v1/completions ")[1].split("\n## ")[0]
    for field in body:
        assert f"| `{field}`" in section, field
    from kvserve.service.request_models import CompletionRequest

    for field in CompletionRequest.UNSUPPORTED:  # known but refused fields say so
        assert re.search(rf"^\| `{field}` \|.*\| not supported", section, flags=re.M), field


# ---------------------------------------------------------------------- vLLM compatibility


def test_vllm_table_marks_kvserves_own_names_implemented(ref):
    rows = ref.compat_rows()
    have = ref.kvserve_names()
    for section, entries in rows.items():
        names = [r["name"] for r in entries]
        assert len(names) == len(set(names)), section
        for r in entries:
            assert r["status"] in ref.BADGE, r
            if r["status"] in ("different", "not applicable"):
                assert r["note"], f"{r['name']}: say how it differs"
            if r["status"] == "missing":
                assert r["name"] not in have[section], f"{r['name']} exists in kvserve"
    assert {"name": "--block-size", "status": "implemented", "note": ""} in rows["serve_flags"]


def test_vllm_table_refuses_a_false_implemented_claim(ref, tmp_path, monkeypatch):
    fake = tmp_path / "compat.yaml"
    fake.write_text("serve_flags:\n  - {name: --no-such-flag, status: implemented}\n")
    monkeypatch.setattr(ref, "COMPAT", fake)
    with pytest.raises(ValueError, match="--no-such-flag"):
        ref.compat_rows()


# ---------------------------------------------------------------------------------- models


def test_every_registered_architecture_has_a_row_in_the_models_page():
    from kvserve.engine.models import MODEL_REGISTRY

    page = (DOCS / "guides" / "models.md").read_text()
    rows = set(re.findall(r"^\| `(\w+ForCausalLM)` \|", page, flags=re.M))
    assert set(MODEL_REGISTRY) <= rows, sorted(set(MODEL_REGISTRY) - rows)


def test_vllm_examples_tally_refuses_a_run_claim_without_its_script(ref, tmp_path, monkeypatch):
    fake = tmp_path / "examples.yaml"
    fake.write_text("offline:\n  - {name: basic/basic.py, status: runs, script: offline/none.py}\n")
    monkeypatch.setattr(ref, "EXAMPLES", fake)
    with pytest.raises(ValueError, match="offline/none.py does not exist"):
        ref.example_rows()
    fake.write_text("online:\n  - {name: api_client.py, status: missing}\n")
    with pytest.raises(ValueError, match="say why"):
        ref.example_rows()
