"""The offline API, exactly as with vLLM: `python examples/offline.py` (or `make run-offline`)."""

from kvserve import LLM, SamplingParams

llm = LLM(
    model="smollm2-135m-instruct",  # the embedded default; also a local HF folder or a hub id
    tensor_parallel_size=1,
    gpu_memory_utilization=0.90,
    max_num_seqs=256,
    max_model_len=4096,
    block_size=16,
    swap_space=4,
    enable_prefix_caching=True,
)
sampling_params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=512)
prompts = [
    "Explain the multi-head attention mechanism in the Transformer architecture",
    "How can the GPU memory efficiency of large model inference be optimised?",
    "What is the difference between PagedAttention and traditional KV cache management?",
]
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    print(f"Prompt: {output.prompt}")
    print(f"Generated: {output.outputs[0].text}")
