"""The `kvserve` CLI: vLLM flag spellings onto EngineConfig / ServerConfig, external commands."""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import fields

import pytest

from kvserve.engine.config import DEFAULT_MODEL, EngineConfig
from kvserve.engine.errors import ConfigError
from kvserve.service import cli


def _serve(*argv: str) -> argparse.Namespace:
    return cli.build_serve_parser().parse_args(list(argv))


def test_issue_command_line_maps_onto_engine_config():
    args = _serve("--model", "smollm2-135m-instruct", "--tensor-parallel-size", "1",
                  "--gpu-memory-utilization", "0.90", "--max-num-seqs", "256",
                  "--enable-prefix-caching", "--port", "8000")
    cfg = cli.engine_config_from_args(args)
    assert cfg == EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.9,
                               max_num_seqs=256, enable_prefix_caching=True)
    assert cli.server_config_from_args(args).port == 8000


def test_every_engine_field_has_a_flag():
    args = _serve()
    missing = [f.name for f in fields(EngineConfig)
               if f.name not in ("served_model_name",) and not hasattr(args, f.name)]
    assert missing == []
    assert cli.engine_config_from_args(args) == EngineConfig()  # defaults agree


def test_engine_flags_with_vllm_spelling():
    args = _serve("my-model", "--block-size", "32", "--max-model-len", "1024",
                  "--max-num-batched-tokens", "512", "--swap-space", "2",
                  "--preemption-mode", "swap", "--no-enable-prefix-caching",
                  "--kv-cache-dtype", "fp8", "--calculate-kv-scales", "--seed", "3",
                  "--kv-cache-memory", "1.5GiB", "--dtype", "bfloat16", "--device", "cpu",
                  "--trust-remote-code", "--served-model-name", "alias", "other",
                  "--quantization", "int8")
    cfg = cli.engine_config_from_args(args)
    assert cfg.quantization == "int8"
    assert (cfg.model, cfg.block_size, cfg.max_model_len, cfg.max_num_batched_tokens) == \
        ("my-model", 32, 1024, 512)
    assert (cfg.swap_space, cfg.preemption_mode, cfg.enable_prefix_caching) == (2.0, "swap", False)
    assert (cfg.kv_cache_dtype, cfg.calculate_kv_scales, cfg.seed) == ("fp8", True, 3)
    assert cfg.kv_cache_memory == 3 << 29 and cfg.dtype == "bfloat16" and cfg.trust_remote_code
    assert cfg.served_model_name == "alias"
    assert cli.server_config_from_args(args).served_model_names == ["alias", "other"]


def test_structured_outputs_backend_flag_both_spellings():
    assert cli.engine_config_from_args(_serve()).structured_outputs_backend == "auto"
    for argv, want in [(("--structured-outputs-config.backend", "guidance"), "guidance"),
                       (("--guided-decoding-backend", "xgrammar"), "xgrammar")]:
        assert cli.engine_config_from_args(_serve(*argv)).structured_outputs_backend == want
    json_form = _serve("--structured-outputs-config", '{"backend": "guidance"}')
    assert cli.engine_config_from_args(json_form).structured_outputs_backend == "guidance"
    with pytest.raises(SystemExit):
        _serve("--structured-outputs-config.backend", "outlines")
    with pytest.raises(ConfigError, match="only 'backend'"):
        cli.engine_config_from_args(_serve("--structured-outputs-config", '{"bakend": "x"}'))
    with pytest.raises(ConfigError, match="structured-outputs-config.backend"):
        cli.engine_config_from_args(_serve("--structured-outputs-config", '{"backend": "x"}'))


def test_default_model_and_conflicting_models():
    assert cli.engine_config_from_args(_serve()).model == DEFAULT_MODEL
    with pytest.raises(ConfigError):
        cli.engine_config_from_args(_serve("a", "--model", "b"))


def test_server_flags(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    args = _serve("--host", "127.0.0.1", "--max-waiting", "5", "--max-body-bytes", "64k",
                  "--allowed-origins", '["http://a", "http://b"]', "--shutdown-grace-period",
                  "2.5", "--public-paths", "/health", "--redis-url", "redis://r:6379/0",
                  "--service-name", "svc", "--advertise-url", "http://me:8000",
                  "--replica-id", "r1")
    sc = cli.server_config_from_args(args)
    assert sc.api_key == "from-env"  # the environment fills in a missing --api-key
    assert (sc.host, sc.max_waiting, sc.max_body_bytes) == ("127.0.0.1", 5, 65536)
    assert sc.allowed_origins == ["http://a", "http://b"] and sc.public_paths == ("/health",)
    assert (sc.shutdown_grace_period, sc.redis_url, sc.service_name) == (2.5, "redis://r:6379/0",
                                                                         "svc")
    assert (sc.advertise_url, sc.replica_id) == ("http://me:8000", "r1")
    assert cli.server_config_from_args(_serve("--api-key", "flag")).api_key == "flag"


def test_engine_core_default_is_the_process_split_on_this_cpu():
    """`kvserve serve` with no --engine-core runs the core in its own process here too (a CPU);
    thread and process stay selectable, anything else is refused by name."""
    from kvserve.engine.engine_core import engine_core_mode

    assert cli.server_config_from_args(_serve()).engine_core == "auto"
    assert engine_core_mode(cli.server_config_from_args(_serve()).engine_core) == "process"
    for mode in ("thread", "process"):
        assert engine_core_mode(cli.server_config_from_args(
            _serve("--engine-core", mode)).engine_core) == mode
    with pytest.raises(ValueError, match="engine core mode 'fork'"):
        engine_core_mode("fork")


def test_edge_flags():
    sc = cli.server_config_from_args(_serve())
    assert sc.max_waiting == "auto" and sc.waiting_limit(max_num_seqs=8) == 32
    assert sc.request_timeout is None and not sc.trust_request_chat_template
    assert not sc.enable_prompt_tokens_details
    sc = cli.server_config_from_args(_serve(
        "--max-waiting", "none", "--request-timeout", "2.5", "--trust-request-chat-template",
        "--chat-template-time-limit", "0.5", "--enable-prompt-tokens-details"))
    assert sc.waiting_limit(8) is None and sc.request_timeout == 2.5
    assert sc.trust_request_chat_template and sc.chat_template_time_limit == 0.5
    assert sc.enable_prompt_tokens_details
    for bad in (["--max-waiting", "0"], ["--max-waiting", "lots"], ["--request-timeout", "0"],
                ["--request-timeout", "inf"], ["--chat-template-time-limit", "-1"]):
        with pytest.raises(SystemExit):
            _serve(*bad)


def test_bad_values_are_refused():
    with pytest.raises(SystemExit):
        _serve("--block-size", "7")
    with pytest.raises(SystemExit):
        _serve("--kv-cache-memory", "lots")
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        cli.engine_config_from_args(_serve("--tensor-parallel-size", "0"))
    assert cli.engine_config_from_args(_serve("--tensor-parallel-size", "3")).tensor_parallel_size == 3


def test_main_reports_config_errors_with_exit_code_2(capsys):
    assert cli.main(["serve", "--gpu-memory-utilization", "1.5"]) == 2
    assert "gpu_memory_utilization" in capsys.readouterr().err


def test_help_lists_subcommands_and_flags():
    text = cli.build_parser().format_help()
    assert "serve" in text and "fetch-model" in text
    serve_help = cli.build_serve_parser().format_help()
    for flag in ("--max-num-seqs", "--enable-prefix-caching", "--api-key", "--max-waiting",
                 "--shutdown-grace-period", "--redis-url", "--served-model-name"):
        assert flag in serve_help


def test_external_commands_register_or_are_skipped(monkeypatch):
    sub = argparse.ArgumentParser().add_subparsers()
    assert not cli.register_external(sub, "kvserve.service.no_such_module")
    module = types.ModuleType("kvserve_fake_cmds")
    module.register = lambda s: s.add_parser("fake")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvserve_fake_cmds", module)
    assert cli.register_external(sub, "kvserve_fake_cmds")
    assert "fake" in sub.choices


def test_a_missing_dependency_of_an_external_module_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "kvserve_broken_cmds.py").write_text("import kvserve_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sub = argparse.ArgumentParser().add_subparsers()
    with pytest.raises(ModuleNotFoundError) as info:
        cli.register_external(sub, "kvserve_broken_cmds")
    assert info.value.name == "kvserve_missing_dependency_xyz"


def test_api_server_module_takes_the_same_flags():
    parser = cli.build_serve_parser(prog="python -m kvserve.service.api_server")
    args = parser.parse_args(["--model", "m", "--port", "9"])
    assert cli.engine_config_from_args(args).model == "m"


@pytest.mark.slow
def test_fetch_model_prints_the_folder(default_model_dir, capsys):
    assert cli.main(["fetch-model"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(default_model_dir)


def test_request_limit_flags_on_server_and_router():
    from kvserve.service.limits import RequestLimits
    from kvserve.service.router.cli import add_arguments, config_from_args

    flags = ["--max-json-depth", "8", "--max-prompts-per-request", "3",
             "--max-prompt-tokens-per-request", "1000", "--max-n", "2", "--max-stop", "5",
             "--max-stop-length", "40", "--max-logprobs", "7", "--max-body-bytes", "2MiB"]
    want = RequestLimits(max_json_depth=8, max_prompts=3, max_prompt_tokens=1000, max_n=2,
                         max_stop=5, max_stop_len=40, max_logprobs=7)
    sc = cli.server_config_from_args(_serve(*flags))
    assert sc.limits == want and sc.max_body_bytes == 2 << 20
    assert cli.server_config_from_args(_serve()).limits == RequestLimits()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rc = config_from_args(parser.parse_args(["--replicas", "http://r:8000", *flags]))
    assert rc.limits == want and rc.max_body_bytes == 2 << 20
    for bad in (["--max-logprobs", "21"], ["--max-n", "0"], ["--max-json-depth", "x"]):
        with pytest.raises(SystemExit):
            _serve(*bad)


def test_kv_offloading_and_preemption_flags():
    cfg = cli.engine_config_from_args(_serve("--kv-offloading-size", "8"))
    assert (cfg.kv_offloading_size, cfg.preemption_mode) == (8.0, "auto")
    assert cli.engine_config_from_args(_serve("--preemption-mode", "recompute")).preemption_mode \
        == "recompute"
    with pytest.raises(SystemExit):
        _serve("--preemption-mode", "evict")
    cfg = cli.engine_config_from_args(_serve(
        "--kv-offloading-size", "8", "--kv-offloading-disk-path", "/var/cache/kv",
        "--kv-offloading-disk-size", "100"))
    assert (cfg.kv_offloading_disk_path, cfg.kv_offloading_disk_size) == ("/var/cache/kv", 100.0)
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        cli.engine_config_from_args(_serve("--kv-offloading-disk-path", "/var/cache/kv",
                                           "--kv-offloading-disk-size", "100"))


def test_vllm_tool_calling_launch_line_and_chat_template(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = _serve("m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                  "--chat-template", str(template), "--served-model-name", "a", "b")
    cfg = cli.server_config_from_args(args)
    assert (cfg.enable_auto_tool_choice, cfg.tool_call_parser) == (True, "llama3_json")
    assert cfg.chat_template == template.read_text() and cfg.served_model_names == ["a", "b"]
    inline = "{{ messages[0].content }}"
    assert cli.server_config_from_args(_serve("--chat-template", inline)).chat_template == inline
    assert cli.server_config_from_args(_serve()).tool_call_parser == "hermes"


@pytest.mark.parametrize("argv, names", [
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
])
def test_vllm_flags_we_refuse_say_which(argv, names):
    with pytest.raises(ConfigError, match=names):
        cli.server_config_from_args(_serve(*argv))


def test_enable_prompt_embeds_reaches_the_engine_config():
    assert cli.engine_config_from_args(_serve("--enable-prompt-embeds")).enable_prompt_embeds
    assert not cli.engine_config_from_args(_serve()).enable_prompt_embeds
    cli.server_config_from_args(_serve("--enable-prompt-embeds"))  # no longer refused


@pytest.mark.parametrize("argv", [["--tool-call-parser", "pythonic"],
                                  ["--chat-template", "/no/such/file"]])
def test_bad_tool_flags_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        _serve(*argv)
    assert argv[0] in capsys.readouterr().err
