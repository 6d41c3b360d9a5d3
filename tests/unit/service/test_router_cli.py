"""`kvserve router`'s hardening flags and their environment fallbacks."""

from __future__ import annotations

import argparse

import pytest
from kvserve.service.router.cli import add_arguments, config_from_args


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(["--replicas", "http://r:8000", *argv]))


def test_defaults_keep_cache_revealing_headers_off_and_deadlines_on(monkeypatch):
    for name in ("KVSERVE_API_KEY", "KVSERVE_REGISTRATION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    cfg = parse()
    assert not cfg.expose_routing_headers and cfg.api_key is None
    assert cfg.registration_token is None
    assert cfg.connect_timeout > 0 and cfg.first_byte_timeout > 0
    assert cfg.public_paths == ("/health", "/metrics")


def test_flags_and_env(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    monkeypatch.setenv("KVSERVE_REGISTRATION_TOKEN", "tok")
    cfg = parse("--upstream-connect-timeout", "0.5", "--upstream-first-byte-timeout", "7",
                "--expose-routing-headers", "--shutdown-grace-period", "90")
    assert (cfg.connect_timeout, cfg.first_byte_timeout) == (0.5, 7.0)
    assert cfg.api_key == "from-env" and cfg.registration_token == "tok"
    assert cfg.expose_routing_headers and cfg.shutdown_grace_period == 90
    assert parse("--api-key", "flag").api_key == "flag"  # the flag wins


@pytest.mark.parametrize("flag", ["--upstream-connect-timeout", "--upstream-first-byte-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_timeouts_must_be_positive(flag, value):
    with pytest.raises(SystemExit, match=flag):
        parse(flag, value)


def test_host_weight_flag():
    assert parse().policy_cfg.host_weight == 0.7
    assert parse("--host-weight", "0.5").policy_cfg.host_weight == 0.5
    for bad in ("-0.1", "1.5"):
        with pytest.raises(SystemExit, match="--host-weight must be between 0 and 1"):
            parse("--host-weight", bad)


def test_lora_modules_in_both_of_vllms_forms():
    cfg = parse("--lora-modules", "sql=/w/adapters/sql",
                '{"name": "chat", "path": "/w/adapters/chat", "base_model_name": "m"}',
                "--lora-modules", "code=/w/a=b", "--lora-load-timeout", "9")
    assert cfg.lora_modules == (("sql", "/w/adapters/sql"), ("chat", "/w/adapters/chat"),
                                ("code", "/w/a=b"))
    assert cfg.lora_load_timeout == 9 and parse().lora_modules == ()


@pytest.mark.parametrize("bad, reason", [
    (["sql"], "write NAME=PATH"), (["=/p"], "must not be empty"), (["sql="], "must not be"),
    (['{"name": "x"}'], '"name" and "path"'), (["a=/x", "a=/y"], "twice"),
])
def test_bad_lora_modules_name_the_reason(bad, reason):
    with pytest.raises(SystemExit, match=reason):
        parse("--lora-modules", *bad)
