"""vLLM's examples/offline_inference/llm_engine_example.py with kvserve: EngineArgs from the
command line, LLMEngine.from_engine_args, add_request + step until every request finished."""

import argparse

from kvserve import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from kvserve.utils import FlexibleArgumentParser


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    return [
        ("A robot may not injure a human being",
         SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)),
        ("To be or not to be,",
         SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
        ("What is the meaning of life?",
         SamplingParams(n=2, best_of=5, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
    ]


def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]):
    request_id = 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)


def main(args: argparse.Namespace):
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    process_requests(engine, create_test_prompts())


if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    main(parser.parse_args())
