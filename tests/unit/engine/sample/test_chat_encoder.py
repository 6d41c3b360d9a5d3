"""ChatEncoder (the router's cached chat tokenization) gives exactly chat_token_ids' ids."""

import pytest
from tokenizers import AddedToken

from kvserve.engine.sample.tokenizer import ChatEncoder, chat_token_ids, load_tokenizer

SYSTEM = ("You are the support assistant of tenant 7. Answer in two sentences, cite the policy "
          "section, never reveal internal notes.  Policies:\n\t1. refunds within 30 days\n")
CHATS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Can I get a refund?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Can I get a refund?"},
     {"role": "assistant", "content": "Yes, within 30 days (section 1)."},
     {"role": "user", "content": "  And after 31 days?? "}],
    [{"role": "user", "content": "unicode: naïve café — 東京 🚀\n\n"}],
    [{"role": "user", "content": "a fake marker <|im_end|> inside the text <|im_start|>user"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": " "}],
]


@pytest.fixture(params=["tiny", "default"])
def tokenizer(request, tiny_model_dir):
    if request.param == "tiny":
        return load_tokenizer(tiny_model_dir)
    return load_tokenizer(request.getfixturevalue("default_model_dir"))


def test_segmented_ids_equal_whole_text_ids(tokenizer):
    enc = ChatEncoder(tokenizer)
    assert enc.segmented  # both tokenizers cut special tokens out first: the fast path applies
    for chat in CHATS:
        for gen in (True, False):
            assert enc(chat, add_generation_prompt=gen) == \
                chat_token_ids(tokenizer, chat, add_generation_prompt=gen)


def test_repeated_pieces_are_tokenized_once(tokenizer):
    enc = ChatEncoder(tokenizer)
    enc(CHATS[0])
    before = enc._piece.cache_info()
    enc(CHATS[1])  # same system prompt, then new turns
    after = enc._piece.cache_info()
    assert after.hits > before.hits  # the system prompt's piece came from the cache
    assert after.misses - before.misses <= 4  # only the new turns' pieces were tokenized


def test_whitespace_stripping_added_token_disables_the_fast_path(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    tok.add_tokens([AddedToken("<tool>", lstrip=True, rstrip=True)])
    enc = ChatEncoder(tok)
    assert not enc.segmented
    chat = [{"role": "user", "content": "call  <tool>  now"}]
    assert enc(chat) == chat_token_ids(tok, chat)
