"""vLLM's examples/offline_inference/logits_processor/custom_req.py with kvserve: a request-level
logits processor (keep only `target_token`) wrapped by AdapterLogitsProcessor into a batch-level
one; it applies to the requests whose SamplingParams.extra_args name a target, and only to those.
(vLLM imports the adapter from vllm.v1.sample.logits_processor; kvserve:
kvserve.engine.sample.logits_processor.)"""

import os

import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.sample.logits_processor import (AdapterLogitsProcessor,
                                                    RequestLogitsProcessor)

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")


class DummyPerReqLogitsProcessor:
    """The request-level logits processor masks out all logits except the
    token id identified by `target_token`"""

    def __init__(self, target_token: int) -> None:
        """Specify `target_token`"""
        self.target_token = target_token

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        val_to_keep = logits[self.target_token].item()
        logits[:] = float("-inf")
        logits[self.target_token] = val_to_keep
        return logits


class WrappedPerReqLogitsProcessor(AdapterLogitsProcessor):
    """Example of wrapping a fake request-level logit processor to create a
    batch-level logits processor"""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """A request-level processor for the request's `target_token`, or None when the
        request names none (its logits are then left alone)."""
        if not params.extra_args or "target_token" not in params.extra_args:
            return None
        return DummyPerReqLogitsProcessor(params.extra_args["target_token"])


# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a mixture of requests which do and don't utilize the dummy logitproc
sampling_params_list = [
    SamplingParams(temperature=0.0, extra_args={"target_token": 128}),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, extra_args={"target_token": 67}),
    SamplingParams(temperature=0.0),
]


def main():
    llm = LLM(model=MODEL, logits_processors=[WrappedPerReqLogitsProcessor])
    outputs = llm.generate(prompts, sampling_params_list)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
