"""Decode graphs with LoRA (stand-in capture, the real Triton decode kernel in the interpreter):
one decode batch mixing two adapters and base rows gives the same greedy tokens and logprobs
replayed as eagerly, the slots read from the graphs' static buffer (padded rows: no adapter);
an adapter loaded into a slot after the capture is served right by the same graphs; with one
rank and with two (every rank replays, each its share of the adapters)."""

from __future__ import annotations

import pytest

from conftest import make_llm
from family_checks import prompts
from graph_checks import StandIn, assert_same_outputs, interpreter  # noqa: F401 - fixture
from kvserve import SamplingParams
from kvserve.lora.request import LoRARequest
from lora_checks import adapters, lora_base  # noqa: F401 - fixtures

PARAMS = SamplingParams(temperature=0, max_tokens=5, logprobs=0, ignore_eos=True)


def _generate(llm, token_prompts, loras):
    items = [{"prompt_token_ids": p} for p in token_prompts for _ in loras]
    return llm.generate(items, PARAMS, use_tqdm=False,
                        lora_request=[r for _ in token_prompts for r in loras])


@pytest.mark.parametrize("ranks", [1, 2])
def test_mixed_adapters_replayed_as_eager_and_a_new_adapter_after_capture(
        lora_base, adapters, tmp_path, ranks):
    a0, a1, a2 = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters[:3])]
    stand_in = StandIn(tmp_path)
    llm = make_llm(lora_base, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8,
                   attention_backend="triton", max_num_seqs=8, max_model_len=64,
                   tensor_parallel_size=ranks)
    try:
        token_prompts = prompts(300, lens=(5, 9), seed=6)
        first, later = [a0, None, a1], [a2, None, a0]  # 6 rows: padded to the graph of 8
        want = _generate(llm, token_prompts, first)
        want_later = _generate(llm, token_prompts, later)
        # the adapters matter: one prompt's rows differ by adapter
        assert len({str(o.outputs[0].token_ids) for o in want[:3]}) == 3
        runner = llm.llm_engine.runner
        llm.llm_engine._capture_decode_graphs(stand_in)
        assert runner.graphs is not None and runner.graphs.sizes == [8, 4, 2, 1]
        got = _generate(llm, token_prompts, first)
        replayed = runner.graphs.replays
        assert replayed >= 4 and stand_in.counts(ranks) == [replayed] * ranks
        # a2 now goes into the slot a1 held: written in place, the graphs read it
        got_later = _generate(llm, token_prompts, later)
        assert "a2" in llm.llm_engine.lora.slots and runner.graphs.replays >= 2 * replayed
        assert stand_in.counts(ranks) == [runner.graphs.replays] * ranks
    finally:
        llm.shutdown()
    assert_same_outputs(got, want)
    assert_same_outputs(got_later, want_later)
