"""vLLM's examples/offline_inference/logits_processor/custom.py with kvserve: a v1 logits processor
class that masks every token but `target_token` for the requests whose SamplingParams.extra_args
name one. (vLLM imports the base from vllm.v1.sample.logits_processor and VllmConfig from
vllm.config; kvserve: kvserve.engine.sample.logits_processor and its EngineConfig.)"""

import os

import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.config import EngineConfig as VllmConfig
from kvserve.engine.sample.logits_processor import (BatchUpdate, LogitsProcessor,
                                                    process_dict_updates)

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")


class DummyLogitsProcessor(LogitsProcessor):
    """Keeps only `target_token` for the requests that ask for it."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _, __: params.extra_args
                             and params.extra_args.get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        rows = torch.tensor(list(self.req_info.keys()), dtype=torch.long, device=logits.device)
        values_to_keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = values_to_keep
        return logits


prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params_list = [
    SamplingParams(temperature=0.0, extra_args={"target_token": 128}),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, extra_args={"target_token": 67}),
    SamplingParams(temperature=0.0),
]


def main():
    llm = LLM(model=MODEL, logits_processors=[DummyLogitsProcessor])
    outputs = llm.generate(prompts, sampling_params_list)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        print(f"Prompt:    {output.prompt!r}")
        print(f"Output:    {output.outputs[0].text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
