"""vLLM's documented examples as kvserve's acceptance suite: every `runs` entry of
docs/gen/vllm_examples.yaml, examples/vllm/<script> (vLLM's example with only the import, the model
and the URL changed). Offline ones run in-process (runpy, as `__main__`) on a tiny built model;
online ones against one `kvserve serve` process shared by the module (the reasoning ones against a
second, with --reasoning-parser, serving a model whose greedy output is a fixed script that reasons
and then calls a tool; the xLAM ones against a third, with --tool-call-parser xlam, whose script
is a sentence and a fenced JSON list of two calls). Each is judged on what it printed, against what the example's own calls
must give."""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
from pathlib import Path

import pytest
import yaml
from conftest import build_tiny_llama, build_tiny_tokenizer
from family_checks import hf_logprobs
from lora_checks import build_adapter, merged_model
from scripted_model import build_scripted_llama
from server_process import api_server_process

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "vllm"
LISTED = yaml.safe_load((ROOT / "docs" / "gen" / "vllm_examples.yaml").read_text())


def runs(kind: str) -> list[str]:
    return [e["script"] for e in LISTED[kind] if e["status"] == "runs"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # 8,192 positions: automatic_prefix_caching.py's table is ~4k tokens of the tiny tokenizer.
    return build_tiny_llama(tmp_path_factory.mktemp("examples") / "tiny",
                            max_position_embeddings=8192)


@pytest.fixture(scope="module")
def lora_dir(model_dir, tmp_path_factory) -> Path:
    """A random PEFT adapter of the tiny model (what multilora_inference.py downloads)."""
    return build_adapter(model_dir, tmp_path_factory.mktemp("lora") / "sql-lora", seed=10)


def run_example(script: str, argv: list[str], capsys) -> str:
    """Run examples/vllm/<script> as `python <script> argv...` in this process; its stdout."""
    path = EXAMPLES / script
    old = sys.argv
    sys.argv = [str(path), *argv]
    try:
        capsys.readouterr()
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = old
    return capsys.readouterr().out


@pytest.fixture
def offline_env(monkeypatch, model_dir, tmp_path):
    monkeypatch.setenv("KVSERVE_EXAMPLE_MODEL", str(model_dir))
    monkeypatch.setenv("KVSERVE_KV_CACHE_MEMORY", str(32 << 20))  # not 1/4 of the host's RAM
    monkeypatch.setenv("KVSERVE_EXAMPLE_SLEEP", "0")
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "profile"))
    monkeypatch.chdir(tmp_path)
    return model_dir


def check_offline(script: str, out: str, model_dir: Path, tmp_path: Path) -> None:
    """What each example's own calls must print."""
    prompts = len(re.findall(r"^Prompt:", out, flags=re.M))
    if script in ("offline/basic.py", "offline/generate.py", "offline/metrics.py",
                  "offline/reproducibility.py", "offline/simple_profiling.py",
                  "offline/logits_processor_custom.py", "offline/logits_processor_custom_req.py"):
        assert prompts == 4, out
    if script == "offline/chat.py":
        assert prompts == 1 + 10, out
    if script in ("offline/logits_processor_custom.py", "offline/logits_processor_custom_req.py"):
        outputs = re.findall(r"^Output:\s+(.*)$", out, flags=re.M)
        tok = build_tiny_tokenizer()
        for i, target in ((0, 128), (2, 67)):  # every token the target, up to max_tokens 16
            assert eval(outputs[i]) == tok.decode([target] * 16), outputs[i]  # noqa: S307
        for i in (1, 3):  # the requests without a target are left alone
            assert eval(outputs[i]) not in (tok.decode([128] * 16), tok.decode([67] * 16))  # noqa: S307
    if script == "offline/metrics.py":
        tokens = re.search(r"^vllm:generation_tokens \(counter\) = (\d+)$", out, flags=re.M)
        assert tokens and int(tokens.group(1)) == 4 * 16, out  # 4 prompts x max_tokens 16
        assert "vllm:num_requests_running (gauge) = 0" in out
    if script in ("offline/llm_engine_example.py", "offline/llm_engine_reset_kv.py"):
        finished = re.findall(r"^RequestOutput\(request_id='(\d+)'", out, flags=re.M)
        assert sorted(finished) == (["0", "1", "2"] if "example" in script else ["0"]), out
    if script == "offline/llm_engine_reset_kv.py":
        assert "Resetting prefix cache at 10" in out
    if script == "offline/async_llm_streaming.py":
        assert out.count("Generation complete!") == 3 and "All streaming examples" in out
    if script == "offline/automatic_prefix_caching.py":
        assert out.count("Generation time:") == 2
    if script == "offline/prompt_embed_inference.py":  # one prompt, then a batch of three
        assert "[Single Inference Output]" in out and "[Batch Inference Outputs]" in out, out
        assert re.findall(r"^A(\d): ", out, flags=re.M) == ["1", "2", "3"], out
    if script == "offline/structured_outputs.py":
        # SamplingParams' default max_tokens is 16 (vLLM's too) and max_model_len=100 cuts the
        # 96-token regex prompt of the tiny tokenizer at 4: outputs may stop early, so each must
        # be a prefix of a string its constraint accepts.
        found = dict(re.findall(r"^Structured outputs by (\w+): (.*)$", out, flags=re.M))
        assert found["Choice"] in ("Positive", "Negative")
        assert re.fullmatch(r"\w+(@(\w+(\.(c(om?)?)?)?)?)?", found["Regex"]), found
        assert found["JSON"].startswith('{"brand": "'), found
        sql = [f"SELECT {a}  from {t}  where {c} = {n} " for a in ("col_1", "col_2")
               for t in ("table_1", "table_2") for c in ("col_1", "col_2") for n in "12"]
        assert any(q.startswith(found["Grammar"]) for q in sql), found
    if script == "offline/simple_profiling.py":
        assert any((tmp_path / "profile").iterdir())
    if script == "offline/spec_decode.py":  # the drafts were scored and the counters read
        drafts = re.search(r"^num_draft_tokens: (\d+)$", out, flags=re.M)
        accepted = re.search(r"^num_accepted_tokens: (\d+)$", out, flags=re.M)
        assert drafts and accepted and int(drafts.group(1)) > 0, out
        assert int(accepted.group(1)) <= int(drafts.group(1)), out
        assert re.search(r"^mean acceptance length: \d", out, flags=re.M), out
    if script == "offline/multilora_inference.py":
        check_multilora(out, model_dir, Path(os.environ["KVSERVE_EXAMPLE_LORA"]))


def check_multilora(out: str, model_dir: Path, adapter: Path) -> None:
    """Two base requests, then the SQL prompt under two names of one adapter: both adapter
    requests give the same greedy tokens, which are HF + peft's (adapter merged) argmax and not
    the base model's, and with max_loras=1 the second name's request finishes after the
    first's."""
    found = re.findall(r"^RequestOutput\(request_id='(\d)', .*?prompt_token_ids=\[([\d, ]+)\]"
                       r".*?CompletionOutput\(index=0, .*?, token_ids=\[([\d, ]+)\](.*)$",
                       out, flags=re.M)
    assert [f[0] for f in found if f[0] in "23"] == ["2", "3"], out
    assert sorted(f[0] for f in found) == ["0", "1", "2", "3"], out
    by_id = {rid: ([int(t) for t in p.split(",")], [int(t) for t in g.split(",")], rest)
             for rid, p, g, rest in found}
    assert "lora_request=None" in by_id["0"][2] and "lora_request=None" in by_id["1"][2]
    assert "lora_name='sql-lora'" in by_id["2"][2] and "lora_name='sql-lora2'" in by_id["3"][2]
    prompt, tokens, _ = by_id["2"]
    assert by_id["3"][:2] == (prompt, tokens)
    head = tokens[:16]  # greedy: a near-tie deep into 128 random-model tokens could flip
    lora_argmax = hf_logprobs(merged_model(model_dir, adapter), prompt, head).argmax(-1).tolist()
    base_argmax = hf_logprobs(merged_model(model_dir, None), prompt, head).argmax(-1).tolist()
    assert head == lora_argmax and head != base_argmax


@pytest.mark.slow
@pytest.mark.parametrize("script", runs("offline"))
def test_offline_example(script, offline_env, capsys, tmp_path, monkeypatch, request):
    if script == "offline/multilora_inference.py":
        monkeypatch.setenv("KVSERVE_EXAMPLE_LORA", str(request.getfixturevalue("lora_dir")))
    source = (EXAMPLES / script).read_text()
    argv = ["--model", str(offline_env)] if "add_cli_args" in source else []
    out = run_example(script, argv, capsys)
    check_offline(script, out, offline_env, tmp_path)
    if script == "offline/reproducibility.py":  # the same run, the same samples
        assert run_example(script, argv, capsys) == out


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with api_server_process(model_dir, log, "--enable-auto-tool-choice", "--tool-call-parser",
                            "hermes") as (_, url):
        yield url


# what the scripted model writes to any chat: reasoning, a sentence, a hermes call
REASONING = "9.8 is greater than 9.11; the weather needs a tool."
CALL_ARGS = '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}'
SCRIPT = ["<think>", REASONING, "</think>", "The answer is below.", "<tool_call>",
          '{"name": "get_current_weather", "arguments": ' + CALL_ARGS + "}", "</tool_call>"]


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    model = build_scripted_llama(tmp_path_factory.mktemp("scripted") / "model", SCRIPT,
                                 max_position_embeddings=2048)
    log = tmp_path_factory.mktemp("server") / "reasoning-server.log"
    with api_server_process(model, log, "--reasoning-parser", "deepseek_r1",
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as (_, url):
        yield url


# what the scripted xLAM-style model writes to any chat: a sentence, then two calls as one JSON
# list in a ```json fence (one of the forms vLLM's xlam parser reads)
XLAM_CALLS = ['{"name": "get_weather", "arguments": {"location": "Tokyo", "unit": "celsius"}}',
              '{"name": "get_weather", "arguments": {"location": "New York", "unit": "celsius"}}']
XLAM_SCRIPT = ["I will look it up.", "\n```json\n", "[" + XLAM_CALLS[0] + ", ",
               XLAM_CALLS[1] + "]", "\n```"]


@pytest.fixture(scope="module")
def xlam_server(tmp_path_factory):
    # 4,096 positions: the example's three tools in the system message are ~2k tiny tokens
    model = build_scripted_llama(tmp_path_factory.mktemp("scripted") / "xlam", XLAM_SCRIPT,
                                 max_position_embeddings=4096)
    log = tmp_path_factory.mktemp("server") / "xlam-server.log"
    with api_server_process(model, log, "--enable-auto-tool-choice",
                            "--tool-call-parser", "xlam") as (_, url):
        yield url


def check_xlam(script: str, out: str) -> None:
    """Each of the four questions: the content before the calls, both calls parsed from the
    fenced list and run by the example, and the follow-up (no tools: the script as text)."""
    cases = out.split("TEST CASE: ")[1:]
    assert len(cases) == 4 and out.rstrip().endswith("All tests completed."), out
    for case in cases:
        assert "Error executing function" not in case, case
        for city in ("Tokyo", "New York"):
            assert f"Weather in {city} is 22 degrees celsius.\n" in case, case
        if script.endswith("_streaming.py"):
            # the content streams first, then each call arrives whole as its object closes
            first = json.dumps(json.loads(XLAM_CALLS[0])["arguments"])
            assert "--- Stream Output ---\nI will look it up.Function called: get_weather\n" \
                f"Arguments chunk: {first}\n" in case, case
            assert case.count("Function called: get_weather\n") == 2, case
            assert case.count("--- Function Result (get_weather) ---") == 2, case
        else:
            assert "Content: I will look it up.\n" in case, case
            assert re.search(r"Tool calls: \[ChatCompletionMessage\w*ToolCall\(", case), case
            for call in XLAM_CALLS:
                assert f"Arguments: {json.dumps(json.loads(call)['arguments'])}\n" in case
            assert case.count("Function ID: call_") == 2, case
        assert "--- Follow-up Response ---\n" + "".join(XLAM_SCRIPT) + "\n--- End Follow-up" \
            in case, case


def check_reasoning(script: str, out: str) -> None:
    """The scripted answer split: reasoning apart from content, the call parsed from content."""
    content = "".join(SCRIPT[3:])  # no tools in the request: the call stays text
    if script == "online/openai_chat_completion_with_reasoning.py":
        for round_ in ("1", "2"):
            assert f"reasoning_content for Round {round_}: {REASONING}\n" in out, out
            assert f"content for Round {round_}: {content}\n" in out, out
    if script == "online/openai_chat_completion_with_reasoning_streaming.py":
        # the role chunk's content "" (vLLM sends it too) prints the "content:" header first
        assert out == ("client: Start streaming chat completions...\n\ncontent:"
                       f"reasoning_content:{REASONING}{content}"), out
    if script == "online/openai_chat_completion_tool_calls_with_reasoning.py":
        parts = out.split("----------")
        auto_whole, auto_stream, named_whole, named_stream = parts[1], parts[3], parts[5], parts[7]
        for part in (auto_whole, auto_stream):
            assert f"reasoning_content: {REASONING}\n" in part, part
            assert f"function arguments: {CALL_ARGS}\n" in part, part
        # a named call is the grammar's from the first token: no reasoning (the model, kept
        # off its script, may write arguments until max_tokens, so they are only begun here)
        assert "reasoning_content: None\n" in named_whole
        assert "reasoning_content: \n" in named_stream
        for part in (auto_whole, auto_stream, named_whole, named_stream):
            assert "function name: get_current_weather\n" in part, part
        for part in (named_whole, named_stream):
            assert re.search(r"function arguments: \{\s*\"", part), part


def check_online(script: str, out: str) -> None:
    if "reasoning" in script:
        check_reasoning(script, out)
    if "xlam" in script:
        check_xlam(script, out)
    if script == "online/openai_completion_client.py":
        assert out.startswith("Completion results:") and out.count("Completion(") >= 2
    if script == "online/openai_chat_completion_client.py":
        assert "ChatCompletion(id=" in out and "role='assistant'" in out
    if script == "online/openai_chat_completion_client_with_tools_required.py":
        last = out.strip().splitlines()[-1]  # the non-streamed call's tool calls
        assert "ChatCompletionMessageFunctionToolCall(" in last or "ToolCall(" in last, last
        assert re.search(r"name='get_(current_weather|forecast)'", last), last
    if script == "online/openai_chat_completion_structured_outputs.py":
        choice, email, car, sql = out.strip().split("\n", 3)
        assert choice in ("positive", "negative")
        assert re.fullmatch(r"\w+@\w+\.com", email), email
        assert json.loads(car)["car_type"] in ("sedan", "SUV", "Truck", "Coupe")
        assert re.fullmatch(r"SELECT [a-zA-Z_][a-zA-Z0-9_]*(,[a-zA-Z_][a-zA-Z0-9_]*)* FROM "
                            r"[a-zA-Z_][a-zA-Z0-9_]*", sql), sql
    if script == "online/openai_chat_completion_structured_outputs_structural_tag.py":
        assert "ChatCompletion(id=" in out
    if script in ("online/openai_responses_client.py",
                  "online/openai_responses_client_with_tools.py"):
        assert out.strip(), "output_text of the second response"


@pytest.mark.slow
@pytest.mark.parametrize("script", runs("online"))
def test_online_example(script, monkeypatch, capsys, request):
    server = request.getfixturevalue("reasoning_server" if "reasoning" in script else
                                     "xlam_server" if "xlam" in script else "server")
    monkeypatch.setenv("KVSERVE_EXAMPLE_BASE_URL", server + "/v1")
    monkeypatch.setenv("KVSERVE_EXAMPLE_SLEEP", "0")
    monkeypatch.setenv("KVSERVE_EXAMPLE_MODEL", "tiny")
    check_online(script, run_example(script, [], capsys))


def test_every_listed_script_exists_and_every_script_is_listed():
    listed = {e["script"] for kind in LISTED.values() for e in kind if "script" in e}
    present = {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.py")}
    assert listed == present
    for kind in LISTED.values():
        for e in kind:
            assert e["status"] in ("runs", "needs a larger model", "missing", "not applicable")
            assert e["status"] == "runs" or e.get("note"), e
