"""vLLM's current example scripts as a user moving from vLLM runs them: tests/vllm_examples/
holds copies (same path as under vLLM's examples/) with only `vllm` -> `kvserve` in the imports
and the model changed to the default model's name. Each runs as its own process on the real
default model: offline ones alone, online ones against one `kvserve serve` started for all of
them, whose URL replaces vLLM's `localhost:8000` when the script is run. Which scripts run, and
why the others do not, is the `current` list of docs/gen/vllm_examples.yaml."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from server_process import api_server_process

ROOT = Path(__file__).resolve().parents[2]
COPIES = ROOT / "tests" / "vllm_examples"
LISTED = yaml.safe_load((ROOT / "docs" / "gen" / "vllm_examples.yaml").read_text())["current"]
MODEL = "smollm2-135m-instruct"  # the name every copy uses (a known name; a folder here too)


def runs(kind: str) -> list[str]:
    return [e["name"] for e in LISTED if e["kind"] == kind and e["status"] == "runs"]


def argv_of(name: str) -> list[str]:
    return next(e.get("argv", []) for e in LISTED if e["name"] == name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, default_model_dir) -> Path:
    """The scripts' working directory: `smollm2-135m-instruct` there is the default model's
    folder, so transformers' AutoTokenizer.from_pretrained(MODEL) finds it offline."""
    work = tmp_path_factory.mktemp("vllm-examples")
    (work / MODEL).symlink_to(default_model_dir, target_is_directory=True)
    return work


def run_script(path: Path, workdir: Path, argv: list[str], url: str | None = None) -> str:
    """Run the copy as `python <copy> argv` in `workdir` (with vLLM's localhost:8000 pointed at
    `url`); its stdout, after checking it exited 0."""
    if url is not None:
        text = path.read_text().replace("http://localhost:8000", url)
        path = workdir / path.name
        path.write_text(text)
    env = {**os.environ, "KVSERVE_KV_CACHE_MEMORY": str(256 << 20), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(path), *argv], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def check_offline(name: str, out: str, tokenizer) -> None:
    """What each script's own calls must print."""
    if name == "offline_inference/basic/basic.py" or "logits_processor/" in name:
        assert len(re.findall(r"^Prompt: ", out, flags=re.M)) == 4, out
    if "logits_processor/" in name:
        outputs = [eval(o) for o in re.findall(r"^Output:\s+(.*)$", out, flags=re.M)]  # noqa: S307
        # SamplingParams' default max_tokens 16: the targeted requests are their token 16 times,
        # except custom_req_init.py's, whose processor turns itself off off CUDA
        targets = [tokenizer.decode([128] * 16), tokenizer.decode([67] * 16)]
        hit = [outputs[0], outputs[2]] == targets
        assert hit != name.endswith("custom_req_init.py"), outputs
        assert outputs[1] not in targets and outputs[3] not in targets
    if name == "features/pause_resume/pause_resume_offline.py":
        assert "Test passed! Engine paused" in out and "Resumed!" in out, out
    if name == "features/sharded_state/load_sharded_state_offline.py":
        assert "using format sharded_state" in out and "Full output: Hello, world!" in out
    if name == "features/reset_kv/reset_kv_offline.py":
        assert "Resetting prefix cache at 10" in out
        finished = re.findall(r"^RequestOutput\(request_id='(\d+)'", out, flags=re.M)
        assert sorted(finished) == ["0", "1", "2", "3"], out
    if name == "features/automatic_prefix_caching/automatic_prefix_caching_offline.py":
        assert out.count("Generation time:") == 2, out
    if name == "features/structured_outputs/structured_outputs_offline.py":
        found = dict(re.findall(r"^Structured outputs by (\w+): (.*)$", out, flags=re.M))
        assert found["Choice"] in ("Positive", "Negative"), found
        # the stop drops the "\n"; MAX_TOKENS (50) may cut the address short
        assert re.fullmatch(r"\w+(@(\w+(\.(c(om?)?)?)?)?)?", found["Regex"]), found
        assert found["JSON"].startswith("{"), found
        assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ",
                            found["Grammar"]), found


@pytest.mark.slow
@pytest.mark.parametrize("name", runs("offline"))
def test_offline_example(name, workdir, default_model_dir):
    from transformers import AutoTokenizer

    if name.endswith("load_sharded_state_offline.py") and not (workdir / "sharded").is_dir():
        save = "features/sharded_state/save_sharded_state_offline.py"  # writes what it loads
        run_script(COPIES / save, workdir, argv_of(save))
    out = run_script(COPIES / name, workdir, argv_of(name))
    check_offline(name, out, AutoTokenizer.from_pretrained(default_model_dir))
    if name.endswith("save_sharded_state_offline.py"):
        assert list((workdir / "sharded").glob("*.safetensors"))
    if name == "features/profiling/simple_profiling_offline.py":
        assert any((workdir / "vllm_profile").iterdir())  # the trace it asked for
    if name == "features/batch_invariance/reproducibility_offline.py":
        assert len(re.findall(r"^Generated text: ", out, flags=re.M)) == 4, out
        assert run_script(COPIES / name, workdir, []) == out  # the same samples, run again


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with api_server_process(default_model_dir, log, "--served-model-name", MODEL,
                            "--kv-cache-memory", "256MiB", "--max-model-len", "2048",
                            timeout=300) as (_, url):
        yield url


def check_online(name: str, out: str) -> None:
    if name == "features/structured_outputs/structured_outputs_client.py":
        found = dict(re.findall(r"^(\w+):\n  Content: (.*)$", out, flags=re.M))
        assert set(found) == {"choice", "regex", "json", "grammar"}, out
        assert eval(found["choice"]) in ("positive", "negative")  # noqa: S307
        assert re.fullmatch(r"[a-z0-9.]{1,20}@\w{6,10}\.com\n", eval(found["regex"]))  # noqa: S307
        assert json.loads(eval(found["json"]))["car_type"] in ("SEDAN", "SUV", "TRUCK", "COUPE")  # noqa: S307
        assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ",
                            eval(found["grammar"])), found  # noqa: S307
    if name == "online_serving/token_generation_client.py":
        assert "'request_id': 'generate-tokens-" in out and "Token generation results:" in out
        assert "'finish_reason': 'length'" in out or "'finish_reason': 'stop'" in out, out
    if name == "online_serving/batched_chat_completions.py":
        sections = out.split("=== Example ")[1:]
        assert len(sections) == 5, out
        assert [len(re.findall(r"^  \[\d\] ", s, flags=re.M)) for s in sections] == \
            [1, 2, 2, 2, 2], out
        assert re.findall(r"^  \[\d\] (.*)$", sections[2], flags=re.M) in (
            [a, b] for a in ("yes", "no") for b in ("yes", "no")), sections[2]


@pytest.mark.slow
@pytest.mark.parametrize("name", runs("online"))
def test_online_example(name, server, workdir):
    check_online(name, run_script(COPIES / name, workdir, argv_of(name), url=server))


def test_every_copy_is_listed_and_names_its_source():
    # every runnable one is here; a copy kept of one that does not run yet is listed with why
    present = {str(p.relative_to(COPIES)) for p in COPIES.rglob("*.py")}
    assert {e["name"] for e in LISTED if e["status"] == "runs"} <= present
    assert present <= {e["name"] for e in LISTED}
    for name in present:
        head = " ".join(line.lstrip("# ") for line in (COPIES / name).read_text().splitlines()[:3])
        assert f"vLLM's examples/{name} (vllm-project/vllm" in head, (name, head)
    for e in LISTED:
        assert e["kind"] in ("offline", "online") and e["status"] in (
            "runs", "needs a larger model", "missing", "not applicable"), e
        assert e["status"] == "runs" or e.get("note"), e
