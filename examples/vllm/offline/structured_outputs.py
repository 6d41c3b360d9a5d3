"""vLLM's examples/offline_inference/structured_outputs.py with kvserve: SamplingParams with
StructuredOutputsParams by choice, regex, a JSON schema (pydantic) and an EBNF grammar."""

import os
from enum import Enum

from pydantic import BaseModel

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")

sampling_params_choice = SamplingParams(
    structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
prompt_choice = "Classify this sentiment: vLLM is wonderful!"

sampling_params_regex = SamplingParams(
    structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), stop=["\n"])
prompt_regex = ("Generate an email address for Alan Turing, who works in Enigma."
                "End in .com and new line. Example result:alan.turing@enigma.com\n")


class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


sampling_params_json = SamplingParams(
    structured_outputs=StructuredOutputsParams(json=CarDescription.model_json_schema()))
prompt_json = ("Generate a JSON with the brand, model and car_type of"
               "the most iconic car from the 90's")

simplified_sql_grammar = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
sampling_params_grammar = SamplingParams(
    structured_outputs=StructuredOutputsParams(grammar=simplified_sql_grammar))
prompt_grammar = "Generate an SQL query to show the 'username' and 'email'from the 'users' table."


def format_output(title: str, output: str):
    print(f"{'-' * 50}\n{title}: {output}\n{'-' * 50}")


def generate_output(prompt: str, sampling_params: SamplingParams, llm: LLM):
    outputs = llm.generate(prompts=prompt, sampling_params=sampling_params)
    return outputs[0].outputs[0].text


def main():
    llm = LLM(model=MODEL, max_model_len=100)
    format_output("Structured outputs by Choice",
                  generate_output(prompt_choice, sampling_params_choice, llm))
    format_output("Structured outputs by Regex",
                  generate_output(prompt_regex, sampling_params_regex, llm))
    format_output("Structured outputs by JSON",
                  generate_output(prompt_json, sampling_params_json, llm))
    format_output("Structured outputs by Grammar",
                  generate_output(prompt_grammar, sampling_params_grammar, llm))


if __name__ == "__main__":
    main()
