"""vLLM's examples/online_serving/openai_chat_completion_client_with_tools_xlam_streaming.py
against a server started with tool calling in xLAM-2's format:

    kvserve serve Salesforce/Llama-xLAM-2-8b-fc-r --enable-auto-tool-choice --tool-call-parser xlam

The streaming sibling: the content and each tool call as they arrive, then the calls run and a
streamed follow-up answer. The delay between the questions is $KVSERVE_EXAMPLE_SLEEP (1 s)."""

import ast
import json
import operator
import os
import time

from openai import OpenAI

# Modify OpenAI's API key and API base to use kvserve's API server.
openai_api_key = "empty"
openai_api_base = os.environ.get("KVSERVE_EXAMPLE_BASE_URL", "http://localhost:8000/v1")


# Define tool functions
def get_weather(location: str, unit: str):
    return f"Weather in {location} is 22 degrees {unit}."


# Supported operators for safe math evaluation (never eval() a model's output).
_SAFE_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.Pow: operator.pow, ast.Mod: operator.mod,
    ast.FloorDiv: operator.floordiv, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def _safe_eval_node(node: ast.AST):
    """Evaluate an AST of numbers and basic arithmetic operators only."""
    if isinstance(node, ast.Expression):
        return _safe_eval_node(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp):
        op_fn = _SAFE_OPERATORS.get(type(node.op))
        if op_fn is None:
            raise ValueError(f"Unsupported operator: {type(node.op).__name__}")
        return op_fn(_safe_eval_node(node.left), _safe_eval_node(node.right))
    if isinstance(node, ast.UnaryOp):
        op_fn = _SAFE_OPERATORS.get(type(node.op))
        if op_fn is None:
            raise ValueError(f"Unsupported operator: {type(node.op).__name__}")
        return op_fn(_safe_eval_node(node.operand))
    raise ValueError(f"Unsupported expression node: {type(node).__name__}")


def calculate_expression(expression: str):
    try:
        result = _safe_eval_node(ast.parse(expression, mode="eval"))
        return f"The result of {expression} is {result}"
    except (SyntaxError, ValueError) as e:
        return f"Could not calculate {expression}: {e}"


def translate_text(text: str, target_language: str):
    return f"Translation of '{text}' to {target_language}: [translated content]"


# Define tools
tools = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given location",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string",
                         "description": "City and state, e.g., 'San Francisco, CA'"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location", "unit"]}}},
    {"type": "function", "function": {
        "name": "calculate_expression",
        "description": "Calculate a mathematical expression",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description":
                           "Mathematical expression to evaluate, e.g., '25 * 17 + 31'"}},
            "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "translate_text",
        "description": "Translate text to another language",
        "parameters": {"type": "object", "properties": {
            "text": {"type": "string", "description": "Text to translate"},
            "target_language": {"type": "string",
                                "description": "Target language for translation"}},
            "required": ["text", "target_language"]}}},
]

# Map of function names to implementations
tool_functions = {
    "get_weather": get_weather,
    "calculate_expression": calculate_expression,
    "translate_text": translate_text,
}


def process_stream(response, tool_functions, original_query):
    """Process a streaming response with possible tool calls"""
    # Track multiple tool calls
    tool_calls = {}  # Dictionary to store tool calls by ID

    current_id = None

    print("\n--- Stream Output ---")
    for chunk in response:
        # Handle tool calls in the stream
        if chunk.choices[0].delta.tool_calls:
            for tool_call_chunk in chunk.choices[0].delta.tool_calls:
                # Get the tool call ID
                if hasattr(tool_call_chunk, "id") and tool_call_chunk.id:
                    current_id = tool_call_chunk.id
                    if current_id not in tool_calls:
                        tool_calls[current_id] = {"function_name": None, "function_args": "",
                                                  "function_id": current_id}

                # Extract function information as it comes in chunks
                if hasattr(tool_call_chunk, "function") and current_id \
                        and current_id in tool_calls:
                    if hasattr(tool_call_chunk.function, "name") \
                            and tool_call_chunk.function.name:
                        tool_calls[current_id]["function_name"] = tool_call_chunk.function.name
                        print(f"Function called: {tool_call_chunk.function.name}")

                    if hasattr(tool_call_chunk.function, "arguments") \
                            and tool_call_chunk.function.arguments:
                        tool_calls[current_id]["function_args"] += \
                            tool_call_chunk.function.arguments
                        print(f"Arguments chunk: {tool_call_chunk.function.arguments}")

        # Handle regular content in the stream
        elif chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="")

    print("\n--- End Stream ---\n")

    # Execute each function call and build messages for follow-up
    follow_up_messages = [{"role": "user", "content": original_query}]

    for tool_id, tool_data in tool_calls.items():  # noqa: PERF102 (as vLLM's example)
        function_name = tool_data["function_name"]
        function_args = tool_data["function_args"]
        function_id = tool_data["function_id"]

        if function_name and function_args:
            try:
                # Parse the JSON arguments
                args = json.loads(function_args)

                # Call the function with the arguments
                function_result = tool_functions[function_name](**args)
                print(f"\n--- Function Result ({function_name}) ---\n{function_result}\n")

                # Add the assistant message with tool call
                follow_up_messages.append({"role": "assistant", "tool_calls": [{
                    "id": function_id, "type": "function",
                    "function": {"name": function_name, "arguments": function_args}}]})

                # Add the tool message with function result
                follow_up_messages.append({"role": "tool", "tool_call_id": function_id,
                                           "content": function_result})

            except Exception as e:  # noqa: BLE001 (as vLLM's example)
                print(f"Error executing function: {e}")

    # Only send follow-up if we have results to process
    if len(follow_up_messages) > 1:
        # Create a follow-up message with all the function results
        follow_up_response = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=follow_up_messages, stream=True)

        print("\n--- Follow-up Response ---")
        for chunk in follow_up_response:
            if chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="")
        print("\n--- End Follow-up ---\n")


def run_test_case(query, test_name):
    """Run a single test case with the given query"""
    print(f"\n{'=' * 50}\nTEST CASE: {test_name}\n{'=' * 50}")
    print(f"Query: '{query}'")

    start_time = time.time()

    # Create streaming chat completion request
    response = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": query}],
        tools=tools,
        tool_choice="auto",
        stream=True,
    )

    # Process the streaming response
    process_stream(response, tool_functions, query)

    end_time = time.time()
    print(f"Test completed in {end_time - start_time:.2f} seconds")


def main():
    # Initialize OpenAI client
    global client
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)

    # Run test cases
    test_cases = [
        ("I want to know the weather in San Francisco", "Weather Information"),
        ("Calculate 25 * 17 + 31", "Math Calculation"),
        ("Translate 'Hello world' to Spanish", "Text Translation"),
        ("What is the weather in Tokyo and New York in celsius", "Multiple Tool Usage"),
    ]

    # Execute all test cases
    for query, test_name in test_cases:
        run_test_case(query, test_name)
        time.sleep(float(os.environ.get("KVSERVE_EXAMPLE_SLEEP", "1")))  # delay between tests

    print("\nAll tests completed.")


if __name__ == "__main__":
    main()
