"""The router's prompt tokens: the engine's own helpers, and never a request's own template."""

from kvserve.engine.sample.tokenizer import chat_token_ids, load_tokenizer
from kvserve.service.router.prompt_tokens import prompt_tokens_for

MESSAGES = [{"role": "user", "content": "Where is the KV cache kept?"}]
RUNAWAY = "{% for i in range(10**12) %}{{ i }}{% endfor %}"


def test_chat_tokens_are_the_engines(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    got = prompt_tokens_for(tok, "/v1/chat/completions", {"messages": MESSAGES})
    assert got == chat_token_ids(tok, MESSAGES, True) and got


def test_a_request_template_is_never_rendered_by_the_router(tiny_model_dir):
    tok = load_tokenizer(str(tiny_model_dir))
    # rendering this would not return: the router must route it by load without running it
    assert prompt_tokens_for(tok, "/v1/chat/completions",
                             {"messages": MESSAGES, "chat_template": RUNAWAY}) is None
    assert prompt_tokens_for(tok, "/v1/chat/completions",
                             {"messages": MESSAGES, "chat_template_kwargs": {"x": 1}}) is None
