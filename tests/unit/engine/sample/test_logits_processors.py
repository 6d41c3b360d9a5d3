"""vLLM v1 custom logits processors: vLLM's documented DummyLogitsProcessor (forces
`extra_args["target_token"]` for the requests that ask) through LLM(logits_processors=[cls]), and
AdapterLogitsProcessor's per-request processors."""

from __future__ import annotations

import pytest
import torch

from conftest import make_llm
from kvserve import SamplingParams
from kvserve.engine.errors import ConfigError
from kvserve.engine.sample.logits_processor import (AdapterLogitsProcessor, BatchUpdate,
                                                    LogitsProcessor, MoveDirectionality)


class DummyLogitsProcessor(LogitsProcessor):
    """vLLM's docs example (docs/design/logits_processors.md), unchanged but for the import."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if not batch_update:
            return
        for index, params, _, _ in batch_update.added:
            assert params is not None
            if params.extra_args and (target := params.extra_args.get("target_token")) is not None:
                self.req_info[index] = target
            else:
                self.req_info.pop(index, None)
        if self.req_info:
            for index in batch_update.removed:
                self.req_info.pop(index, None)
            for adx, bdx, direct in batch_update.moved:
                a_val = self.req_info.pop(adx, None)
                b_val = self.req_info.pop(bdx, None)
                if a_val is not None:
                    self.req_info[bdx] = a_val
                if direct == MoveDirectionality.SWAP and b_val is not None:
                    self.req_info[adx] = b_val

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


def test_dummy_processor_forces_the_target_only_where_asked(tiny_model_dir, llm):
    forced = make_llm(tiny_model_dir, logits_processors=[DummyLogitsProcessor])
    prompts = ["Hello there", "The quick brown fox", "abc", "0123456789"]
    # the plain requests end first: the forced last one moves into the freed slot 0
    lengths = [3, 9, 5, 7]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             extra_args={"target_token": 7 + i} if i % 2 else None)
              for i, n in enumerate(lengths)]
    got = forced.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, params, use_tqdm=False)
    for i, (g, p) in enumerate(zip(got, plain)):
        if i % 2:
            assert g.outputs[0].token_ids == [7 + i] * lengths[i]
        else:
            assert g.outputs[0].token_ids == p.outputs[0].token_ids
    assert plain[3].outputs[0].token_ids != [10] * 7
    forced.shutdown()
    with pytest.raises(ConfigError, match="LogitsProcessor"):
        make_llm(tiny_model_dir, logits_processors=[int])


class EchoLast(AdapterLogitsProcessor):
    """Per request (with `echo` in extra_args): force the token the request's prompt ends with
    while the output is shorter than `echo`, then the output's last token + 1. Both lists are
    read live, so this fails unless each row keeps its own request's ids across moves."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        if not (params.extra_args or {}).get("echo"):
            return None
        n = params.extra_args["echo"]

        def force(prompt_ids, output_ids, logits):
            token = prompt_ids[-1] if len(output_ids) < n else output_ids[-1] + 1
            logits[:] = float("-inf")
            logits[token] = 0.0
            return logits
        return force


def test_adapter_runs_each_requests_own_processor(tiny_model_dir, llm):
    wrapped = make_llm(tiny_model_dir, logits_processors=[EchoLast])
    prompts = [[5, 6, 7], [20, 21], [30, 31, 40], [50]]
    lengths = [3, 9, 5, 7]  # the plain first request ends first: the rows move
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             extra_args={"echo": 2} if i else None)
              for i, n in enumerate(lengths)]
    got = wrapped.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    for i in (1, 2, 3):
        last = prompts[i][-1]
        want = [last, last] + [last + k for k in range(1, lengths[i] - 1)]
        assert got[i].outputs[0].token_ids == want
    wrapped.shutdown()
