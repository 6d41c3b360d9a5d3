"""`kvserve epp`'s flags: the names the operator renders, the router's scoring flags carried into
the same RouterConfig, and the errors for a missing or bad endpoint source."""

from __future__ import annotations

import pytest

from kvserve.service.cli import build_parser
from kvserve.service.epp.cli import config_from_args


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(["epp", *argv]))


def test_the_operator_flags(tmp_path):
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text("batch: -1\nchat: 2\n")
    cfg = parse("--grpc-port", "9002", "--grpc-health-port", "9003", "--metrics-port", "9090",
                "--pool-name", "chat", "--pool-namespace", "llm", "--secure-serving",
                "--fallback-list", "--objectives", str(objectives))
    assert (cfg.grpc_port, cfg.grpc_health_port, cfg.metrics_port) == (9002, 9003, 9090)
    assert (cfg.pool_name, cfg.pool_namespace) == ("chat", "llm")
    assert cfg.secure_serving and cfg.fallback_list
    assert cfg.objectives.priorities == {"batch": -1, "chat": 2}


def test_router_scoring_flags_become_the_router_config():
    cfg = parse("--redis-url", "redis://r:6379/0", "--service-name", "svc",
                "--load-weight", "0.5", "--overload-factor", "3", "--host-weight", "0.2",
                "--min-match-tokens", "64", "--policy", "least-load")
    r = cfg.router
    assert (r.redis_url, r.service_name, r.policy) == ("redis://r:6379/0", "svc", "least-load")
    pc = r.policy_cfg
    assert (pc.load_weight, pc.overload_factor, pc.host_weight, pc.min_match_tokens) == \
        (0.5, 3.0, 0.2, 64)


def test_static_endpoints_in_order_without_duplicates():
    cfg = parse("--endpoints", "10.0.0.2:8000, 10.0.0.1:8000,10.0.0.2:8000")
    assert cfg.endpoints == ("10.0.0.2:8000", "10.0.0.1:8000")
    assert cfg.router.redis_url is None


@pytest.mark.parametrize("argv, message", [
    ((), "pass --endpoints"),
    (("--endpoints", "10.0.0.1"), "not host:port"),
    (("--endpoints", "10.0.0.1:99999"), "not host:port"),
    (("--endpoints", "10.0.0.1:80", "--host-weight", "2"), "--host-weight"),
])
def test_bad_flags_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert message in str(info.value)


@pytest.mark.parametrize("flag, loop", [(None, "uvloop.Loop"), ("auto", "uvloop.Loop"),
                                        ("uvloop", "uvloop.Loop"),
                                        ("asyncio", "asyncio.unix_events._UnixSelectorEventLoop")])
def test_the_loop_flag_picks_the_event_loop_the_epp_runs_on(flag, loop):
    import asyncio

    from kvserve.service.epp.cli import loop_runner

    ns = build_parser().parse_args(["epp", "--endpoints", "a:1", *(["--loop", flag] if flag
                                                                    else [])])

    async def which() -> str:
        running = type(asyncio.get_running_loop())
        return f"{running.__module__}.{running.__qualname__}"

    assert loop_runner(ns.loop)(which()) == loop
