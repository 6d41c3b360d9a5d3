"""vLLM's examples/offline_inference/reproducibility.py with kvserve: LLM(seed=42) makes sampled
outputs, and the global random state the script sees after, the same run after run."""

import os
import random

from kvserve import LLM, SamplingParams

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's; kvserve's engine is in-process
MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")
SEED = 42

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model=MODEL, seed=SEED)
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 50)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
        print("-" * 50)
    print(random.randint(0, 100))


if __name__ == "__main__":
    main()
