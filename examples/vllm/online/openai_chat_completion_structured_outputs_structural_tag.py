"""vLLM's examples/online_serving/openai_chat_completion_structured_outputs_structural_tag.py
against `kvserve serve`: response_format structural_tag (a JSON schema between <function=...>
and </function>, triggered by "<function=")."""

import os

from openai import OpenAI

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")
PROMPT = """
You have access to the following function to retrieve the weather in a city:

    {"name": "get_weather", "parameters": {"city": {"param_type": "string",
     "description": "The city to get the weather for", "required": True}}}

If a you choose to call a function ONLY reply in the following format:
<{start_tag}={function_name}>{parameters}{end_tag}
where start_tag => `<function`, parameters => a JSON dict with the function argument name as key
and function argument value as value, end_tag => `</function>`

Here is an example,
<function=example_function_name>{"example_name": "example_value"}</function>

Given the previous instructions, what is the weather in New York City, Boston,
and San Francisco?
"""


def main():
    client = OpenAI(base_url=os.environ.get("KVSERVE_EXAMPLE_BASE_URL",
                                            "http://localhost:8000/v1"), api_key="-")
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}],
        response_format={
            "type": "structural_tag",
            "structures": [{"begin": "<function=get_weather>",
                            "schema": {"type": "object",
                                       "properties": {"city": {"type": "string"}}},
                            "end": "</function>"}],
            "triggers": ["<function="],
        })
    print(response)


if __name__ == "__main__":
    main()
