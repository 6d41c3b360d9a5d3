"""vLLM's examples/online_serving/openai_chat_completion_structured_outputs.py against
`kvserve serve`: guided_choice, guided_regex, guided_json (pydantic) and guided_grammar (Lark)
through the openai client's extra_body."""

import os
from enum import Enum

from openai import OpenAI
from pydantic import BaseModel

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")
client = OpenAI(base_url=os.environ.get("KVSERVE_EXAMPLE_BASE_URL", "http://localhost:8000/v1"),
                api_key="-")

completion = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}],
    extra_body={"guided_choice": ["positive", "negative"]},
)
print(completion.choices[0].message.content)

prompt = ("Generate an email address for Alan Turing, who works in Enigma."
          "End in .com and new line. Example result:alan.turing@enigma.com\n")
completion = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": prompt}],
    extra_body={"guided_regex": r"\w+@\w+\.com\n", "stop": ["\n"]},
)
print(completion.choices[0].message.content)


class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


prompt = "Generate a JSON with the brand, model and car_type ofthe most iconic car from the 90's"
completion = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": prompt}],
    extra_body={"guided_json": CarDescription.model_json_schema()},
)
print(completion.choices[0].message.content)

simplified_sql_grammar = """
    ?start: select_statement

    ?select_statement: "SELECT " column_list " FROM " table_name

    ?column_list: column_name ("," column_name)*

    ?table_name: identifier

    ?column_name: identifier

    ?identifier: /[a-zA-Z_][a-zA-Z0-9_]*/
"""
prompt = "Generate an SQL query to show the 'username' and 'email'from the 'users' table."
completion = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": prompt}],
    extra_body={"guided_grammar": simplified_sql_grammar},
)
print(completion.choices[0].message.content)
