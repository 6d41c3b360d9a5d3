"""vLLM's examples/offline_inference/async_llm_streaming.py with kvserve: AsyncLLM from
AsyncEngineArgs, DELTA streaming of three prompts, shutdown. (vLLM imports AsyncLLM from
vllm.v1.engine.async_llm; kvserve has no v1 package: kvserve.engine.async_llm.)"""

import asyncio
import os

from kvserve.engine.arg_utils import AsyncEngineArgs
from kvserve.engine.async_llm import AsyncLLM
from kvserve.sampling_params import RequestOutputKind, SamplingParams

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")


async def stream_response(engine: AsyncLLM, prompt: str, request_id: str) -> None:
    print(f"\nPrompt: {prompt!r}")
    print("Response: ", end="", flush=True)
    sampling_params = SamplingParams(max_tokens=100, temperature=0.8, top_p=0.95, seed=42,
                                     output_kind=RequestOutputKind.DELTA)
    async for output in engine.generate(request_id=request_id, prompt=prompt,
                                        sampling_params=sampling_params):
        for completion in output.outputs:
            if completion.text:
                print(completion.text, end="", flush=True)
        if output.finished:
            print("\nGeneration complete!")
            break


async def main():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=MODEL, enforce_eager=True))
    try:
        prompts = ["The future of artificial intelligence is", "In a galaxy far, far away",
                   "The key to happiness is"]
        for i, prompt in enumerate(prompts, 1):
            await stream_response(engine, prompt, f"stream-example-{i}")
            if i < len(prompts):
                await asyncio.sleep(0.5)
        print("\nAll streaming examples completed!")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
