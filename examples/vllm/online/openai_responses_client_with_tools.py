"""vLLM's examples/online_serving/openai_responses_client_with_tools.py against `kvserve serve`:
a required function call through the Responses API, its output sent back in a second call."""

import json
import os

from openai import OpenAI


def get_weather(latitude: float, longitude: float) -> str:
    return f"Current temperature at ({latitude}, {longitude}) is 20°C."


tools = [{
    "type": "function",
    "name": "get_weather",
    "description": "Get current temperature for provided coordinates in celsius.",
    "parameters": {"type": "object",
                   "properties": {"latitude": {"type": "number"},
                                  "longitude": {"type": "number"}},
                   "required": ["latitude", "longitude"], "additionalProperties": False},
    "strict": True,
}]

input_messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def main():
    base_url = os.environ.get("KVSERVE_EXAMPLE_BASE_URL", "http://localhost:8000/v1")
    model = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")
    client = OpenAI(base_url=base_url, api_key="empty")
    response = client.responses.create(model=model, input=input_messages, tools=tools,
                                       tool_choice="required")
    tool_call = response.output[0]
    args = json.loads(tool_call.arguments)
    result = get_weather(args["latitude"], args["longitude"])
    input_messages.append(tool_call)
    input_messages.append({"type": "function_call_output", "call_id": tool_call.call_id,
                           "output": str(result)})
    response_2 = client.responses.create(model=model, input=input_messages, tools=tools)
    print(response_2.output_text)


if __name__ == "__main__":
    main()
