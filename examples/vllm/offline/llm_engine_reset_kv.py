"""vLLM's examples/offline_inference/llm_engine_reset_kv.py with kvserve: the LLMEngine step loop,
resetting the prefix cache at step 10 with the running requests preempted."""

import argparse
import os

from kvserve import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from kvserve.utils import FlexibleArgumentParser


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    return [("A robot may not injure a human being",
             SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16))]


def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
    request_id = 0
    step_id = 0
    while test_prompts or engine.has_unfinished_requests():
        print("-" * 50)
        print(f"Step {step_id} (pid={os.getpid()})")
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        if step_id == 10:
            print(f"Resetting prefix cache at {step_id}")
            engine.reset_prefix_cache(reset_running_requests=True)
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)
        step_id += 1


def main(args: argparse.Namespace):
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    process_requests(engine, create_test_prompts())


if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    main(parser.parse_args())
