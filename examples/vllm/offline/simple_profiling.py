"""vLLM's examples/offline_inference/simple_profiling.py with kvserve: the torch profiler around
one generate call, traces to $VLLM_TORCH_PROFILER_DIR (set here to ./vllm_profile unless the
environment sets it)."""

import os
import time

from kvserve import LLM, SamplingParams

os.environ.setdefault("VLLM_TORCH_PROFILER_DIR", "./vllm_profile")
MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

if __name__ == "__main__":
    llm = LLM(model=MODEL, tensor_parallel_size=1)
    llm.start_profile()
    outputs = llm.generate(prompts, sampling_params)
    llm.stop_profile()
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    time.sleep(float(os.environ.get("KVSERVE_EXAMPLE_SLEEP", "10")))  # vLLM's wait for MP writers
