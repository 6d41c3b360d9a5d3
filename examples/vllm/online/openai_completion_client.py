"""vLLM's examples/online_serving/openai_completion_client.py against `kvserve serve`: the first
served model, one streamed completion, every chunk printed. URL: $KVSERVE_EXAMPLE_BASE_URL or
http://localhost:8000/v1."""

import os

from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = os.environ.get("KVSERVE_EXAMPLE_BASE_URL", "http://localhost:8000/v1")


def main():
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
    model = client.models.list().data[0].id
    stream = True
    completion = client.completions.create(model=model,
                                           prompt="A robot may not injure a human being",
                                           echo=False, stream=stream)
    print("Completion results:")
    if stream:
        for c in completion:
            print(c)
    else:
        print(completion)


if __name__ == "__main__":
    main()
