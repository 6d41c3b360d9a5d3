"""vLLM's examples/offline_inference/automatic_prefix_caching.py with kvserve: two questions
behind one long shared table; the second finds the table's KV blocks cached. (The table is ours:
30 rows of the same columns.)"""

import os
import time

from kvserve import LLM, SamplingParams

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")

NAMES = ["John Doe", "Jane Smith", "Alice Johnson", "Bob Brown", "Carol White", "Dave Green",
         "Emma Black", "Frank Blue", "Grace Yellow", "Henry Violet", "Irene Orange",
         "Jack Indigo", "Karen Red", "Leo Brown", "Mia Green", "Noah Yellow", "Olivia Blue",
         "Peter Black", "Quinn White", "Rachel Red", "Steve Green", "Tina Blue", "Umar Black",
         "Victor Yellow", "Wendy Orange", "Xavier Green", "Yara Red", "Zack Blue", "Amy White",
         "Ben Black"]
JOBS = ["Engineer", "Doctor", "Teacher", "Artist", "Scientist", "Lawyer", "Musician", "Chef"]
COUNTRIES = ["USA", "Canada", "UK", "Australia", "New Zealand", "Ireland"]
LONG_PROMPT = (
    "You are a helpful assistant in recognizes the content of tables in markdown format. "
    "Here is a table as follows.\n# Table\n"
    "| ID | Name | Age | Occupation | Country | Email | Phone Number |\n"
    "|----|------|-----|------------|---------|-------|--------------|\n"
    + "".join(f"| {i + 1} | {n} | {25 + (7 * i) % 26} | {JOBS[i % 8]} | {COUNTRIES[i % 6]} | "
              f"{n.split()[0].lower()}@example.com | 555-{1000 + 37 * i} |\n"
              for i, n in enumerate(NAMES)))


def get_generation_time(llm, sampling_params, prompts):
    start_time = time.time()
    output = llm.generate(prompts, sampling_params=sampling_params)
    end_time = time.time()
    print("-" * 30)
    print(f"Output: {output[0].outputs[0].text}")
    print(f"Generation time: {end_time - start_time} seconds.")
    print("-" * 30)


def main():
    llm = LLM(model=MODEL, enable_prefix_caching=True)
    sampling_params = SamplingParams(temperature=0, max_tokens=100)
    get_generation_time(llm, sampling_params, LONG_PROMPT
                        + "Question: what is the age of John Doe? Your answer: The age of "
                          "John Doe is ")
    get_generation_time(llm, sampling_params, LONG_PROMPT
                        + "Question: what is the age of Zack Blue? Your answer: The age of "
                          "Zack Blue is ")


if __name__ == "__main__":
    main()
