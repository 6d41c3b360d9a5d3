"""vLLM's examples/online_serving/openai_chat_completion_client.py against `kvserve serve`: a
multi-turn chat completion with the first served model, printed whole."""

import os

from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = os.environ.get("KVSERVE_EXAMPLE_BASE_URL", "http://localhost:8000/v1")

messages = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]


def main():
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
    model = client.models.list().data[0].id
    chat_completion = client.chat.completions.create(messages=messages, model=model)
    print("-" * 50)
    print("Chat completion results:")
    print(chat_completion)
    print("-" * 50)


if __name__ == "__main__":
    main()
