"""vLLM's examples/online_serving/openai_chat_completion_with_reasoning.py against a server
started with a reasoning parser:

    kvserve serve deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --reasoning-parser deepseek_r1

Two rounds of chat; each answer's reasoning_content and content printed apart."""

import os

from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = os.environ.get("KVSERVE_EXAMPLE_BASE_URL", "http://localhost:8000/v1")


def main():
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
    models = client.models.list()
    model = models.data[0].id

    # Round 1
    messages = [{"role": "user", "content": "9.11 and 9.8, which is greater?"}]
    # For granite, add: `extra_body={"chat_template_kwargs": {"thinking": True}}`
    response = client.chat.completions.create(model=model, messages=messages)

    reasoning_content = response.choices[0].message.reasoning_content
    content = response.choices[0].message.content

    print("reasoning_content for Round 1:", reasoning_content)
    print("content for Round 1:", content)

    # Round 2
    messages.append({"role": "assistant", "content": content})
    messages.append({"role": "user", "content": "How many Rs are there in the word 'strawberry'?"})
    response = client.chat.completions.create(model=model, messages=messages)

    reasoning_content = response.choices[0].message.reasoning_content
    content = response.choices[0].message.content

    print("reasoning_content for Round 2:", reasoning_content)
    print("content for Round 2:", content)


if __name__ == "__main__":
    main()
