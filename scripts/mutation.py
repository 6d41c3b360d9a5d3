"""`make mutation`: cosmic-ray over the core modules, each against only the unit tests that cover
it, in a scratch copy of the tree (build/mutation/tree) so the checkout is never left mutated.

Usage: python scripts/mutation.py [MODULE ...] [--list] [--sample N] [--lines A-B] [--recheck];
results in build/mutation/<module>.*.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# KVSERVE_MUTATION_DIR: another scratch folder, so two runs (two module lists) can go side by side.
WORK = Path(os.environ.get("KVSERVE_MUTATION_DIR", ROOT / "build" / "mutation")).resolve()
TREE = WORK / "tree"
SHIM = WORK / "path"  # holds `kvserve` -> tree, first on PYTHONPATH, ahead of the editable install


@dataclass(frozen=True)
class Target:
    name: str
    path: str  # the module, relative to the repository root
    tests: tuple[str, ...]  # the unit test files that cover it
    deselect: str = ""  # a -k expression dropping slow tests that do not exercise the module
    timeout: float = 60.0  # seconds per mutant's test run; a mutant that hangs counts as killed
    lua: bool = False  # also mutate the Lua bodies (string constants cosmic-ray never touches)
    plugins: tuple[str, ...] = ()  # pytest plugins beyond asyncio (autoload is off: faster)


_INDEX_TESTS = ("tests/unit/service/test_prefix_index.py", "tests/unit/service/test_tier_routing.py",
                "tests/unit/service/test_index_trust.py")
_NO_ENGINE = "not real_engine_events and not never_logs_the_redis_password"
_OPERATOR = "tests/unit/operator/"
_CORE, _OFFLOAD = "tests/unit/engine/core/", "tests/unit/engine/kv_offload/"
_SAMPLE = "tests/unit/engine/sample/"

TARGETS = [
    Target("prefix_index_scripts", "service/prefix_index/scripts.py", _INDEX_TESTS, _NO_ENGINE,
           lua=True),
    Target("prefix_index_lookup", "service/prefix_index/lookup.py", _INDEX_TESTS, _NO_ENGINE),
    Target("routing_policy", "service/routing_policy.py",
           ("tests/unit/service/test_routing_policy.py", "tests/unit/service/test_tier_routing.py"),
           _NO_ENGINE),
    Target("sizing", "operator/sizing.py",
           tuple(_OPERATOR + f for f in ("test_sizing.py", "test_sizing_edges.py",
                                         "test_offload.py", "test_spec.py", "test_resources.py",
                                         "test_plan_tables.py"))),
    Target("resources", "operator/resources.py",
           tuple(_OPERATOR + f for f in ("test_resources.py", "test_resources_edges.py",
                                         "test_day_two.py", "test_offload.py", "test_spec.py",
                                         "test_trust.py", "test_leader_worker_set.py"))),
    Target("block_pool", "engine/core/block_pool.py", (_CORE + "test_block_pool.py",)),
    Target("kv_cache_manager", "engine/core/kv_cache_manager.py",
           tuple(_CORE + f for f in ("test_kv_cache_manager.py", "test_kv_cache_manager_paths.py",
                                     "test_resumable.py", "test_scheduler_paths.py",
                                     "test_kv_cache_groups.py", "test_block_pool.py",
                                     "test_kv_cache_model.py"))),  # last: 8 s of hypothesis
    Target("scheduler", "engine/core/scheduler.py",
           (_CORE + "test_scheduler.py", _CORE + "test_scheduler_paths.py",
            _CORE + "test_scheduler_lora.py",
            "tests/unit/lora/test_manager.py::test_scheduler_admits_at_most_max_loras_adapters")),
    Target("sampler", "engine/sample/sampler.py",
           (_SAMPLE + "test_sampler.py", _SAMPLE + "test_sampler_paths.py"),
           "not anywhere_in_any_batch", timeout=120.0),
    Target("host_tier", "engine/kv_offload/host_tier.py", (_CORE + "test_host_tier.py",),
           timeout=120.0),
    # Its tests take about a second; a mutant that stops the writer thread hangs them until the
    # timeout (about one in eight), so a shorter one saves most of the run's time.
    Target("disk_tier", "engine/kv_offload/disk_tier.py",
           (_OFFLOAD + "test_disk_tier.py", _OFFLOAD + "test_disk_tier_paths.py"), timeout=20.0),
    Target("reconcile", "operator/reconcile.py",
           tuple(_OPERATOR + f for f in ("test_reconcile.py", "test_apply_prune.py",
                                         "test_trust.py")), plugins=("kmock._internal.pytest",)),
]

# One replacement per operator, the one a slip of the hand makes (mutmut's choice): the other ten
# replacements of `+` are killed by whatever kills `-` and would only multiply the test runs.
_KEEP_BINARY = ("Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Mul|Mod_FloorDiv|Pow_Mul|LShift_RShift|"
                "RShift_LShift|BitOr_BitAnd|BitAnd_BitOr|BitXor_BitOr")
_KEEP_COMPARE = "Eq_NotEq|NotEq_Eq|Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Is_IsNot|IsNot_Is|In_NotIn|NotIn_In"
_EXCLUDED = re.compile(rf"core/ReplaceBinaryOperator_(?!(?:{_KEEP_BINARY})$)"
                       rf"|core/ReplaceComparisonOperator_(?!(?:{_KEEP_COMPARE})$)"
                       r"|core/ReplaceUnaryOperator_(?!Delete_|USub_UAdd$)")


def copy_tree() -> None:
    """A fresh copy of the working tree (uncommitted edits included) and the import shim."""
    if TREE.exists():
        shutil.rmtree(TREE)
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", "*.egg-info",
                                    ".pytest_cache", ".hypothesis")
    shutil.copytree(ROOT, TREE, ignore=ignore, symlinks=True)
    SHIM.mkdir(parents=True, exist_ok=True)
    link = SHIM / "kvserve"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(TREE, target_is_directory=True)


def test_command(t: Target) -> str:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "pytest_asyncio.plugin",
           *(a for p in t.plugins for a in ("-p", p)), *t.tests]
    if t.deselect:
        cmd += ["-k", t.deselect]
    return shlex.join(cmd)


def test_env() -> dict[str, str]:
    """The copy's kvserve first on the path; no plugin autoload and no torch import in conftest
    (TRITON_INTERPRET preset, as conftest sets it on CPU): 0.8 s a run instead of 3.4 s. The C++
    CPU kernels are off (no module here is a kernel): the torch path needs no build, and no wait
    on another process's build lock."""
    path = os.pathsep.join([str(SHIM), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"TRITON_INTERPRET": "1", "KVSERVE_CPU_KERNEL": "0", "KVSERVE_FUSED_OPS": "0",
            **os.environ, "PYTHONPATH": path,
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def write_config(t: Target) -> Path:
    cfg = WORK / f"{t.name}.toml"
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(t.path)}\n"
        f"timeout = {t.timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(test_command(t))}\n"
        "[cosmic-ray.distributor]\nname = \"local\"\n")
    return cfg


Span = tuple[tuple[int, int], tuple[int, int]]


def _span(a: ast.AST, b: ast.AST | None = None) -> Span:
    b = b or a
    return (a.lineno, a.col_offset), (b.end_lineno, b.end_col_offset)


def _spans(tree: ast.Module) -> dict[str, list[Span]]:
    """Where annotations, default values (parameters, class-body fields) and binary operators
    (between their operands) lie; positions are (line, column) as cosmic-ray records them."""
    out: dict[str, list[Span]] = {"annotation": [], "default": [], "binop": []}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out["annotation"] += [_span(node.returns)] if node.returns else []
            out["default"] += [_span(d) for d in node.args.defaults + node.args.kw_defaults if d]
        elif isinstance(node, ast.arg) and node.annotation:
            out["annotation"].append(_span(node.annotation))
        elif isinstance(node, ast.AnnAssign):
            out["annotation"].append(_span(node.annotation))
        elif isinstance(node, ast.ClassDef):
            out["default"] += [_span(s.value) for s in node.body
                               if isinstance(s, (ast.Assign, ast.AnnAssign)) and s.value]
        elif isinstance(node, (ast.BinOp, ast.AugAssign)):
            left = node.left if isinstance(node, ast.BinOp) else node.target
            right = node.right if isinstance(node, ast.BinOp) else node.value
            out["binop"].append(((left.end_lineno, left.end_col_offset),
                                 (right.lineno, right.col_offset)))
    return out


def _inside(pos: tuple[int, int], spans: list[Span]) -> bool:
    return any(a <= pos < b for a, b in spans)


def skip_reason(source: str, tree: ast.Module, mutation) -> str | None:
    """Why a mutant is not worth a test run, or None: a replacement outside the kept set; an
    operator token that is no arithmetic (`*` marking keyword-only parameters, `**` unpacking);
    a type annotation (never evaluated under `from __future__ import annotations`); a number
    that is a parameter's or a config field's default (a tuning value: a test would restate it);
    code that no longer compiles."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    if _EXCLUDED.match(mutation.operator_name):
        return "operator not in the kept set"
    start, spans = tuple(mutation.start_pos), _spans(tree)
    name = mutation.operator_name
    if name.startswith("core/ReplaceBinaryOperator") and not _inside(start, spans["binop"]):
        return "not an arithmetic operator"
    if "from __future__ import annotations" in source and _inside(start, spans["annotation"]):
        return "type annotation"
    if name == "core/NumberReplacer" and _inside(start, spans["default"]):
        return "default value"
    op = get_operator(mutation.operator_name)(**(mutation.operator_args or {}))
    mutated = mutate_code(source, op, mutation.occurrence)
    try:
        compile(mutated, "<mutant>", "exec")
    except SyntaxError:
        return "not valid Python"
    return None


@dataclass(frozen=True)
class Subset:
    """A part of a module's mutants, for a module whose full run takes too long: the mutants on
    lines [lo, hi], then a seeded random sample of n of them. The rest are recorded as skipped
    ("outside the lines", "not in the sample"), so a score over a subset says so."""
    lines: tuple[int, int] | None = None
    sample: int | None = None
    seed: int = 0


def filter_session(session: Path, subset: Subset = Subset()) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session), WorkDB.Mode.open) as db:
        trees: dict[str, ast.Module] = {}
        kept = []
        for item in list(db.pending_work_items):
            (mutation,) = item.mutations
            source = (TREE / mutation.module_path).read_text()
            reason = skip_reason(source, trees.setdefault(source, ast.parse(source)), mutation)
            line = mutation.start_pos[0]
            if not reason and subset.lines and not subset.lines[0] <= line <= subset.lines[1]:
                reason = "outside the lines"
            if reason:
                db.set_result(item.job_id, WorkResult(output=reason,
                                                      worker_outcome=WorkerOutcome.SKIPPED))
            else:
                kept.append(item.job_id)
        if subset.sample is not None and subset.sample < len(kept):
            chosen = set(random.Random(subset.seed).sample(sorted(kept), subset.sample))
            for job_id in kept:
                if job_id not in chosen:
                    db.set_result(job_id, WorkResult(output="not in the sample",
                                                     worker_outcome=WorkerOutcome.SKIPPED))


def run_cosmic_ray(t: Target, env: dict[str, str], subset: Subset = Subset()) -> None:
    """Baseline first: if the tests fail unmutated, every mutant would count as killed."""
    base = subprocess.run(shlex.split(test_command(t)), cwd=TREE, env=env, capture_output=True,
                          text=True)
    if base.returncode != 0:
        sys.exit(f"{t.name}: the tests fail without any mutant:\n{base.stdout[-3000:]}")
    cfg, session = write_config(t), WORK / f"{t.name}.sqlite"
    session.unlink(missing_ok=True)
    cr = [sys.executable, "-m", "cosmic_ray.cli"]
    subprocess.run([*cr, "init", str(cfg), str(session)], cwd=TREE, env=env, check=True)
    filter_session(session, subset)
    subprocess.run([*cr, "exec", str(cfg), str(session)], cwd=TREE, env=env, check=True)


def _changed_lines(diff: str) -> list[str]:
    return [line for line in diff.splitlines() if line[:1] in "+-"
            and not line.startswith(("+++", "---")) and line[1:].strip()]


def _mutant_source(source: str, mutation, diff: str) -> str | None:
    """The module with a recorded mutant applied again, or None when the module changed since
    the run (the recorded diff's changed lines are not what the mutant changes now)."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    op = get_operator(mutation.operator_name)(**(mutation.operator_args or {}))
    mutated = mutate_code(source, op, mutation.occurrence)
    now = "\n".join(difflib.unified_diff(source.splitlines(), mutated.splitlines(),
                                        lineterm=""))
    return mutated if _changed_lines(now) == _changed_lines(diff) else None


def recheck(t: Target, env: dict[str, str]) -> None:
    """Run the last run's survivors again, against the target's tests as they are now (after
    tests were added for them): each one these tests kill is recorded as killed ("killed on
    recheck"), so the summary scores the current tests without a full run. A survivor whose diff
    no longer applies (the module changed since) is left as it was and named."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    with use_db(str(WORK / f"{t.name}.sqlite"), WorkDB.Mode.open) as db:
        survivors = [(item, r) for item, r in db.completed_work_items
                     if r.worker_outcome == WorkerOutcome.NORMAL and not r.is_killed]
        for item, result in survivors:
            path = TREE / item.mutations[0].module_path
            source = path.read_text()
            mutated = _mutant_source(source, item.mutations[0], result.diff)
            try:
                if mutated is None:
                    print(f"{t.name}: survivor no longer applies: {item.mutations[0].operator_name}"
                          f" at line {item.mutations[0].start_pos[0]}")
                    continue
                path.write_text(mutated)
                try:
                    rc = subprocess.run(shlex.split(test_command(t)), cwd=TREE, env=env,
                                        capture_output=True, timeout=t.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = -1
            finally:
                path.write_text(source)
            if rc != 0:
                db.set_result(item.job_id, WorkResult(
                    worker_outcome=WorkerOutcome.NORMAL, output="killed on recheck",
                    test_outcome=TestOutcome.KILLED, diff=result.diff))


# Lua tokens and their mutants: comparison, arithmetic, logic, and small integer constants.
_LUA_SWAPS = {"==": "~=", "~=": "==", "<=": "<", ">=": ">", "<": "<=", ">": ">=", "+": "-",
              "-": "+", " and ": " or ", " or ": " and ", "not ": ""}
_LUA_TOKEN = re.compile(r"--[^\n]*|'[^'\n]*'|==|~=|<=|>=|(?<![-<>=~])[<>](?!=)|\+|(?<=[\w)\]] )-(?= )"
                        r"| and | or |\bnot |\b\d+\b")


def lua_mutants(source: str) -> list[tuple[int, str, str]]:
    """(offset, original, replacement) for each Lua mutant in the module's long string
    constants (the script bodies; the docstring is not one)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    out = []
    for node in tree.body:
        if not (isinstance(node, ast.Assign) or isinstance(node, ast.AnnAssign)):
            continue
        for const in ast.walk(node):
            if not (isinstance(const, ast.Constant) and isinstance(const.value, str)
                    and "\n" in const.value):
                continue
            lo = starts[const.lineno - 1] + const.col_offset
            hi = starts[const.end_lineno - 1] + const.end_col_offset
            for m in _LUA_TOKEN.finditer(source, lo + 3, hi - 3):
                tok = m.group()
                if tok.startswith("--") or tok.startswith("'"):
                    continue  # comments and Lua string literals
                new = str(int(tok) + 1) if tok.isdigit() else _LUA_SWAPS[tok]
                out.append((m.start(), tok, new))
    return out


def run_lua(t: Target, env: dict[str, str]) -> list[dict]:
    """Each Lua mutant against the module's tests, as cosmic-ray runs a Python one."""
    path = TREE / t.path
    source = path.read_text()
    results = []
    try:
        for offset, old, new in lua_mutants(source):
            path.write_text(source[:offset] + new + source[offset + len(old):])
            line = source.count("\n", 0, offset) + 1
            try:
                rc = subprocess.run(shlex.split(test_command(t)), cwd=TREE, env=env,
                                    capture_output=True, timeout=t.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = -1
            results.append({"line": line, "from": old, "to": new, "killed": rc != 0,
                            "text": source.splitlines()[line - 1].strip()})
    finally:
        path.write_text(source)
    (WORK / f"{t.name}.lua.json").write_text(json.dumps(results, indent=1))
    return results


def summarise(t: Target) -> dict:
    """Counts and the survivors' diffs (build/mutation/<name>.survivors.txt)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome

    killed = survived = skipped = 0
    diffs, reasons = [], {}
    with use_db(str(WORK / f"{t.name}.sqlite"), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome in (WorkerOutcome.SKIPPED, WorkerOutcome.NO_TEST):
                skipped += 1
                reasons[result.output] = reasons.get(result.output, 0) + 1
            elif result.is_killed:
                killed += 1
            else:
                survived += 1
                diffs.append(f"### {item.mutations[0].operator_name}\n{result.diff}\n")
    row = {"module": t.name, "killed": killed, "total": killed + survived, "skipped": skipped,
           "reasons": reasons}
    lua = WORK / f"{t.name}.lua.json"
    if t.lua and lua.exists():
        runs = json.loads(lua.read_text())
        row["lua_killed"], row["lua_total"] = sum(r["killed"] for r in runs), len(runs)
        diffs += [f"### Lua line {r['line']}: {r['from']!r} -> {r['to']!r}: {r['text']}\n"
                  for r in runs if not r["killed"]]
    (WORK / f"{t.name}.survivors.txt").write_text("\n".join(diffs))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("modules", nargs="*", help="target names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the targets and their tests")
    ap.add_argument("--report", action="store_true", help="summarise the last run, run nothing")
    ap.add_argument("--no-lua", action="store_true", help="skip the Lua mutants (slow)")
    ap.add_argument("--recheck", action="store_true",
                    help="rerun only the last run's survivors against the tests as they are now")
    ap.add_argument("--lines", metavar="A-B", help="only the mutants on lines A to B")
    ap.add_argument("--sample", type=int, metavar="N",
                    help="a seeded random sample of N mutants (after --lines), for a slow module")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    args = ap.parse_args(argv)
    by_name = {t.name: t for t in TARGETS}
    if args.list:
        for t in TARGETS:
            print(f"{t.name:24} {t.path}\n{'':24} {test_command(t)}")
        return 0
    unknown = [m for m in args.modules if m not in by_name]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; choose from {sorted(by_name)}")
    targets = [by_name[m] for m in args.modules] or TARGETS
    lines = None
    if args.lines:
        m = re.fullmatch(r"(\d+)-(\d+)", args.lines)
        if not m:
            ap.error(f"--lines wants A-B (two line numbers), got {args.lines!r}")
        lines = (int(m[1]), int(m[2]))
    if args.sample is not None and args.sample < 1:
        ap.error(f"--sample wants a positive count, got {args.sample}")
    subset = Subset(lines, args.sample, args.seed)
    WORK.mkdir(parents=True, exist_ok=True)
    if not args.report:
        copy_tree()
        env = test_env()
        for t in targets:
            if args.recheck:
                recheck(t, env)
                continue
            run_cosmic_ray(t, env, subset)
            if t.lua and not args.no_lua:
                run_lua(t, env)
    print(f"{'module':24} {'killed':>7} {'total':>6} {'score':>6}  (skipped)")
    skips: dict[str, int] = {}
    for t in targets:
        r = summarise(t)
        for reason, n in r["reasons"].items():
            skips[reason] = skips.get(reason, 0) + n
        rows = [(t.name, r["killed"], r["total"])]
        if "lua_total" in r:
            rows.append((t.name + " (Lua)", r["lua_killed"], r["lua_total"]))
        for name, k, n in rows:
            print(f"{name:24} {k:7} {n:6} {100 * k / max(n, 1):5.1f}%  ({r['skipped']})")
    print(f"survivors: {WORK}/<module>.survivors.txt; not run: {dict(sorted(skips.items()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
