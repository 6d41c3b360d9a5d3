"""Token in, token out: tokenizer and detokenizer, sampling params, the sampler, logprobs, best_of,
generation config."""
