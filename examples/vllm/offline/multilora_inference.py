"""vLLM's examples/offline_inference/multilora_inference.py with kvserve: one LLMEngine with
enable_lora, two base-model requests and two requests of one adapter under two names
(max_loras=1: the second name's request waits for the first's to finish), add_request with
lora_request= + step until all are finished. Model: $KVSERVE_EXAMPLE_MODEL or kvserve's default;
adapter (a PEFT folder): $KVSERVE_EXAMPLE_LORA in place of vLLM's snapshot_download of
yard1/llama-2-7b-sql-lora-test."""

import os

from kvserve import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from kvserve.lora.request import LoRARequest

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")
LORA_PATH = os.environ.get("KVSERVE_EXAMPLE_LORA", "/adapters/sql-lora")

SQL_PROMPT = ("[user] Write a SQL query to answer the question based on the table schema.\n\n"
              " context: CREATE TABLE table_name_74 (icao VARCHAR, airport VARCHAR)\n\n"
              " question: Name the ICAO for lilongwe international airport [/user] [assistant]")


def create_test_prompts(lora_path: str) -> list[tuple[str, SamplingParams, LoRARequest | None]]:
    greedy = {"temperature": 0.0, "logprobs": 1, "prompt_logprobs": 1, "max_tokens": 128}
    return [
        ("A robot may not injure a human being", SamplingParams(**greedy), None),
        ("To be or not to be,",
         SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=128), None),
        (SQL_PROMPT, SamplingParams(**greedy, stop_token_ids=[32003]),
         LoRARequest("sql-lora", 1, lora_path)),
        (SQL_PROMPT, SamplingParams(**greedy, stop_token_ids=[32003]),
         LoRARequest("sql-lora2", 2, lora_path)),
    ]


def process_requests(engine: LLMEngine,
                     test_prompts: list[tuple[str, SamplingParams, LoRARequest | None]]):
    request_id = 0
    print("-" * 50)
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params, lora_request = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params,
                               lora_request=lora_request)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)
                print("-" * 50)


def initialize_engine() -> LLMEngine:
    # max_loras: adapters in one batch; max_lora_rank: the largest rank accepted;
    # max_cpu_loras: adapters kept in host memory.
    engine_args = EngineArgs(model=MODEL, enable_lora=True, max_loras=1, max_lora_rank=8,
                             max_cpu_loras=2, max_num_seqs=256)
    return LLMEngine.from_engine_args(engine_args)


def main():
    engine = initialize_engine()
    test_prompts = create_test_prompts(LORA_PATH)
    process_requests(engine, test_prompts)


if __name__ == "__main__":
    main()
