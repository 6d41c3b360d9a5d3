"""Speculative decoding: proposers draft tokens, the target model scores them in one forward,
the rejection sampler keeps the ones the target's distribution allows (engine/spec_decode/)."""
