"""vLLM's examples/offline_inference/basic/chat.py with kvserve: LLM.chat on one conversation, on
a batch of ten (with a progress bar), and with a chat template read from a file."""

import os
from argparse import Namespace

from kvserve import LLM, EngineArgs, SamplingParams
from kvserve.utils import FlexibleArgumentParser


def main(args: Namespace):
    chat_template_path = args.chat_template_path
    del args.chat_template_path
    sampling_params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_p=args.top_p, top_k=args.top_k)
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        delattr(args, name)
    llm = LLM(**vars(args))

    def print_outputs(outputs):
        for output in outputs:
            print(f"Prompt: {output.prompt!r}")
            print(f"Generated text: {output.outputs[0].text!r}")
        print("-" * 80)

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    print_outputs(llm.chat(conversation, sampling_params, use_tqdm=False))
    conversations = [conversation for _ in range(10)]
    print_outputs(llm.chat(conversations, sampling_params, use_tqdm=True))
    if chat_template_path:
        with open(chat_template_path) as f:
            chat_template = f.read()
        print_outputs(llm.chat(conversations, sampling_params, use_tqdm=False,
                               chat_template=chat_template))


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.set_defaults(model=os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct"))
    parser.add_argument("--chat-template-path", type=str, default=None)
    main(parser.parse_args())
