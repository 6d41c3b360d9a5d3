"""Talk to a running `kvserve serve` (or `make run`) with the official openai client.

    python examples/client.py                       # streams an answer from localhost:8000
    python examples/client.py --base-url http://my-host:8000/v1 --prompt "What is paged attention?"
"""

import argparse
import os

import openai

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--base-url", default="http://localhost:8000/v1")
parser.add_argument("--model", default="smollm2-135m-instruct")
parser.add_argument("--prompt", default="Explain how the KV cache works")
parser.add_argument("--max-tokens", type=int, default=512)
args = parser.parse_args()

client = openai.Client(base_url=args.base_url, api_key=os.environ.get("KVSERVE_API_KEY", "dummy"))
response = client.chat.completions.create(
    model=args.model,
    messages=[{"role": "user", "content": args.prompt}],
    temperature=0.7, max_tokens=args.max_tokens, stream=True,
    stream_options={"include_usage": True},
)
for chunk in response:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        details = chunk.usage.prompt_tokens_details  # with --enable-prompt-tokens-details
        cached = details.cached_tokens if details else "?"
        print(f"\n\n[{chunk.usage.prompt_tokens} prompt tokens ({cached} cached), "
              f"{chunk.usage.completion_tokens} generated]")
