"""The engine core in its own process (vLLM v1's EngineCore / client split): the core steps the
engine and sends one message per step; the client, in the API or `LLM` process, turns those
messages into `RequestOutput`s (detokenising there) and calls engine methods as RPCs."""
