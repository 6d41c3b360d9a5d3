"""vLLM's examples/offline_inference/spec_decode.py with kvserve, its n-gram path: LLM with a
speculative_config, generate, then the spec_decode_* metrics of llm.get_metrics() and the
mean acceptance length. The prompts are inlined (vLLM draws them with vllm.benchmarks.datasets,
which kvserve has not); the reader types come from kvserve.engine.metrics_reader (vLLM:
vllm.v1.metrics.reader); EAGLE and MTP need their checkpoints, so --method defaults to ngram."""

import argparse
import os

from kvserve import LLM, SamplingParams
from kvserve.engine.metrics_reader import Counter, Vector

MODEL = os.environ.get("KVSERVE_EXAMPLE_MODEL", "smollm2-135m-instruct")
PROMPTS = [
    "Summarise this text, reusing its words: paged attention stores keys and values in "
    "blocks; the scheduler allocates blocks as tokens arrive and frees them at the end.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, "
    "Sunday. Again: Monday, Tuesday,",
    "Count: one two three four five six seven eight nine ten, one two three",
]


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", type=str, default="ngram", choices=["ngram", "suffix"])
    parser.add_argument("--num-spec-tokens", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--enable-chunked-prefill", action="store_true")
    parser.add_argument("--temp", type=float, default=0)
    parser.add_argument("--print-output", action="store_true")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model-dir", type=str, default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.method == "ngram":
        speculative_config = {
            "method": "ngram",
            "num_speculative_tokens": args.num_spec_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
    else:
        speculative_config = {"method": args.method,
                              "num_speculative_tokens": args.num_spec_tokens}
    llm = LLM(
        model=args.model_dir or MODEL,
        tensor_parallel_size=args.tp,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enforce_eager=args.enforce_eager,
        speculative_config=speculative_config,
        disable_log_stats=False,
        max_model_len=1024,
        max_num_seqs=args.batch_size or 256,
    )
    sampling_params = SamplingParams(temperature=args.temp, max_tokens=args.output_len)
    outputs = llm.generate(PROMPTS, sampling_params=sampling_params)
    if args.print_output:
        for output in outputs:
            print("-" * 50)
            print(f"prompt: {output.prompt}")
            print(f"generated text: {output.outputs[0].text}")
            print("-" * 50)

    total_num_output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    num_drafts = num_draft_tokens = num_accepted_tokens = 0
    acceptance_counts = [0] * args.num_spec_tokens
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            assert isinstance(metric, Counter)
            num_drafts += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            assert isinstance(metric, Counter)
            num_draft_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            assert isinstance(metric, Counter)
            num_accepted_tokens += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            assert isinstance(metric, Vector)
            for pos in range(len(metric.values)):
                acceptance_counts[pos] += metric.values[pos]

    print("-" * 50)
    print(f"total_num_output_tokens: {total_num_output_tokens}")
    print(f"num_drafts: {num_drafts}")
    print(f"num_draft_tokens: {num_draft_tokens}")
    print(f"num_accepted_tokens: {num_accepted_tokens}")
    acceptance_length = 1 + (num_accepted_tokens / num_drafts) if num_drafts > 0 else 1
    print(f"mean acceptance length: {acceptance_length:.2f}")
    print("-" * 50)
    for i in range(len(acceptance_counts)):
        acceptance_rate = acceptance_counts[i] / num_drafts if num_drafts > 0 else 0
        print(f"acceptance at token {i}: {acceptance_rate:.2f}")


if __name__ == "__main__":
    main()
