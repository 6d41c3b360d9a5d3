"""vLLM's sharded-state checkpoints on the tiny random Llama: LLM.save_sharded_state (and vLLM's
example's `llm.llm_engine.engine_core.save_sharded_state`) writes one set of safetensors files
per tensor-parallel rank; LLM(folder, load_format="sharded_state") reads each rank's own back and
generates the tokens of the original checkpoint. TP=2 runs two gloo ranks on the CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from conftest import make_llm
from forked_workers import forked_workers
from kvserve import SamplingParams
from kvserve.engine.errors import ConfigError
from kvserve.model_executor.model_loader import ShardedStateLoader

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module", autouse=True)
def _forked_workers():
    """Workers fork from a preloaded fork server (forked_workers.py): no import each."""
    with forked_workers():
        yield


def copy_metadata(model_dir: Path, out: Path) -> None:
    """vLLM's example copies every file but the weights next to the shards."""
    for f in model_dir.iterdir():
        if f.suffix not in (".bin", ".pt", ".safetensors") and f.is_file():
            shutil.copy(f, out)


def tokens(llm) -> list[int]:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def save(model_dir: Path, folder: Path, tp: int) -> tuple[Path, list[int]]:
    """The model saved at `tp` ranks with vLLM's example's call, and its greedy tokens."""
    llm = make_llm(model_dir, tensor_parallel_size=tp)
    want = tokens(llm)
    llm.llm_engine.engine_core.save_sharded_state(path=str(folder), pattern=None,
                                                  max_size=64 << 10)
    llm.shutdown()
    copy_metadata(Path(model_dir), folder)
    return folder, want


class Saved(dict):
    """tp -> (folder, tokens), each saved on first use (TP=2 costs two processes: slow tests)."""

    def __init__(self, model_dir: Path, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.model_dir, self.factory = model_dir, factory

    def __missing__(self, tp: int) -> tuple[Path, list[int]]:
        self[tp] = save(self.model_dir, self.factory.mktemp(f"sharded-tp{tp}"), tp)
        return self[tp]


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory) -> Saved:
    return Saved(Path(tiny_model_dir), tmp_path_factory)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_load_sharded_state_gives_the_tokens_of_the_checkpoint(saved, tp):
    folder, want = saved[tp]
    for rank in range(tp):  # 64 KiB parts: the split into parts is exercised
        assert len(list(folder.glob(f"model-rank-{rank}-part-*.safetensors"))) > 1
    assert not list(folder.glob(f"model-rank-{tp}-*"))
    loaded = make_llm(folder, tensor_parallel_size=tp, load_format="sharded_state")
    assert tokens(loaded) == want
    loaded.shutdown()


def shapes(folder: Path, rank: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for file in folder.glob(f"model-rank-{rank}-part-*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return out


@pytest.mark.slow
def test_each_rank_holds_only_its_shard(saved):
    """Two ranks split the attention heads: each rank's q/k/v rows are half the model's."""
    whole, half0, half1 = shapes(saved[1][0], 0), shapes(saved[2][0], 0), shapes(saved[2][0], 1)
    qkv = next(k for k in whole if "qkv" in k or "q_proj" in k)
    assert half0[qkv] == half1[qkv] and half0[qkv][0] * 2 == whole[qkv][0]
    assert set(half0) == set(whole) == set(half1)


@pytest.mark.slow
def test_loading_shards_of_another_tensor_parallel_size_is_refused(saved):
    assert ShardedStateLoader.TP_ONLY_PATTERN == "model-rank-{rank}-part-{part}.safetensors"
    with pytest.raises(Exception, match="tensor_parallel_size"):
        make_llm(saved[2][0], tensor_parallel_size=1, load_format="sharded_state")


def test_a_folder_without_shards_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ConfigError, match="no model-rank-0-part-"):
        make_llm(tiny_model_dir, load_format="sharded_state")
