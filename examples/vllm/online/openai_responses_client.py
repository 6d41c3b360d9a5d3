"""vLLM's examples/online_serving/openai_responses_client.py against `kvserve serve`: one
Responses API call, its reasoning items (none without a reasoning parser) carried into a second."""

import os

from openai import OpenAI

input_messages = [{"role": "user", "content": "What model are you?"}]


def main():
    base_url = os.environ.get("KVSERVE_EXAMPLE_BASE_URL", "http://localhost:8000/v1")
    client = OpenAI(base_url=base_url, api_key="empty", timeout=60.0, max_retries=3)
    model = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")
    response = client.responses.create(model=model, input=input_messages)
    for message in response.output:
        if message.type == "reasoning":
            input_messages.append(message)
    response_2 = client.responses.create(model=model, input=input_messages)
    print(response_2.output_text)


if __name__ == "__main__":
    main()
