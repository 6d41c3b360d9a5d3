"""spec.models: small models placed in each replica of spec.model when sizing says they fit —
the engine flags (read back by the real serve CLI), the utilisation and KV budget the other
models' weights come out of, status.sizing's figures, and each refusal by name."""

from __future__ import annotations

import pytest

from kvserve.operator.resources import engine_args
from kvserve.operator.sizing import plan
from kvserve.operator.spec import InvalidSpecError, parse_spec

MiB, GiB = 1 << 20, 1 << 30
TINY = {"name": "tiny", "uri": "org/tiny-chat",
        "architecture": {"layers": 16, "kvHeads": 2, "headDim": 64, "parameters": 200_000_000}}


def service(**spec: object) -> dict:
    return {"metadata": {"name": "s", "namespace": "ns", "uid": "u"}, "spec": spec}


def planned(models: list[dict], gpu: str = "A100-80GB", **spec: object):
    s = parse_spec(service(model={"name": "smollm2-135m"}, gpu={"type": gpu}, models=models,
                           engine={"maxModelLen": 4096, "dtype": "bfloat16"}, **spec))
    return s, plan(s)


def test_small_models_share_the_replica_and_the_engine_reads_the_flags():
    from kvserve.service.cli import build_parser, engine_config_from_args, server_config_from_args

    spec, sizing = planned([TINY])
    alone = plan(parse_spec(service(model={"name": "smollm2-135m"}, gpu={"type": "A100-80GB"},
                                    engine={"maxModelLen": 4096, "dtype": "bfloat16"})))
    co = sizing.co_location
    extra = 200_000_000 * 2
    assert co.extra_weight_bytes == extra and co.kv_bytes == alone.kv_bytes - extra
    assert co.pool_blocks == (alone.kv_bytes - extra) // alone.bytes_per_block
    assert sizing.as_status()["coLocatedModels"]["models"] == ["tiny"]
    assert "1 more model(s) in each replica (tiny)" in sizing.explanation
    args = build_parser().parse_args(engine_args(spec, sizing))
    assert server_config_from_args(args).additional_models == [("tiny", "org/tiny-chat")]
    util = engine_config_from_args(args).gpu_memory_utilization
    assert util == pytest.approx(0.9 - extra / (81920 * MiB), abs=1e-4) and util < 0.9


def test_cpu_pods_get_the_shared_pool_as_their_kv_budget():
    from kvserve.service.cli import build_parser, engine_config_from_args

    spec = parse_spec(service(model={"name": "smollm2-135m"}, device="cpu", models=[TINY],
                              resources={"limits": {"memory": "8Gi"}},
                              engine={"maxModelLen": 2048}))
    sizing = plan(spec)
    config = engine_config_from_args(build_parser().parse_args(engine_args(spec, sizing)))
    assert config.kv_cache_memory == sizing.co_location.kv_bytes < sizing.kv_bytes


def test_models_that_do_not_fit_are_refused_with_the_figures():
    big = dict(TINY, name="big", architecture=dict(TINY["architecture"],
                                                   parameters=40_000_000_000))
    with pytest.raises(InvalidSpecError, match="do not fit one replica.*74.51 GiB leaves 0 blocks"):
        planned([big])


def test_a_model_with_a_larger_kv_block_than_the_primary_is_refused():
    wide = dict(TINY, name="wide", architecture=dict(TINY["architecture"], layers=40,
                                                     kvHeads=4))
    with pytest.raises(InvalidSpecError, match="'wide' needs .* bytes per KV block.*largest"):
        planned([wide])


def test_claim_sources_and_duplicate_names_are_refused():
    with pytest.raises(InvalidSpecError, match="from pvc://"):
        planned([dict(TINY, uri="pvc://weights/tiny")])
    with pytest.raises(InvalidSpecError, match="served names must differ"):
        planned([TINY, dict(TINY, uri="org/other")])


def test_no_models_no_co_location():
    _, sizing = planned([])
    assert sizing.co_location is None and "coLocatedModels" not in sizing.as_status()
