"""Incremental detokenizing: the DecodeStream fast path gives decode()'s text, streamed as pieces
that only ever grow, and the same text and stop strings as the generic path it replaces."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.engine.sample.detokenizer import (FastIncrementalDetokenizer, IncrementalDetokenizer,
                                               decode_stream_backend, new_detokenizer)
from kvserve.engine.sample.tokenizer import load_tokenizer

TEXTS = [
    "The capital of France is Paris. It has 2.1 million people.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 in one go.",
    "中文：你好，世界！日本語のテキスト。한국어 텍스트.",
    "Mixed: naïve café — “quotes” … ½ ∑ x² ≠ y³ 🚀\n\tindent  two spaces",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
]
_CORPUS = ["The quick brown fox jumps over the lazy dog.",
           "What is the capital of France? The capital of France is Paris.",
           "0123456789 !?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~` abcdefghijklmnopqrstuvwxyz"]


def build_byte_fallback_tokenizer(style: str):
    """A SentencePiece-like BPE with byte fallback, trained offline in milliseconds: "legacy" is
    the Llama-2 layout (Prepend+Replace normalizer, a decoder ending in Strip(' ', 1, 0)),
    "metaspace" the newer one (Metaspace pre-tokenizer and decoder, prepend_scheme "first")."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if style == "legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
        decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # the <0xNN> pieces: byte fallback for every character not in vocab
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def smollm(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module", params=["legacy", "metaspace"])
def sp_tok(request):
    return build_byte_fallback_tokenizer(request.param)


def stream(det, out: list[int], rng: random.Random | None = None) -> tuple[list[str], str | None]:
    """Feed `out` as the engine does (the whole list each step; with `rng`, 1-3 tokens a step);
    returns the text after each step and the stop string, flushing if none matched."""
    texts, i = [], 0
    while i < len(out):
        i = min(len(out), i + (rng.randint(1, 3) if rng else 1))
        stop = det.update(out[:i])
        texts.append(det.text)
        if stop is not None:
            return texts, stop
    det.flush(out)
    texts.append(det.text)
    return texts, None


def in_context(tok, prompt: list[int], out: list[int], skip: bool) -> str:
    """What the output reads as after the prompt: its last 5 tokens as left context."""
    ctx = prompt[-5:]
    if tok.decode(ctx, skip_special_tokens=skip).endswith("\ufffd"):
        ctx = []
    head = tok.decode(ctx, skip_special_tokens=skip)
    whole = tok.decode(ctx + out, skip_special_tokens=skip)
    assert whole.startswith(head)
    return whole[len(head):]


def assert_streams(tok, prompt: list[int], out: list[int], skip: bool, expect: str,
                   chunks: int | None = None) -> None:
    """Both paths stream `out` to `expect`, one token a step or (seed `chunks`) 1-3."""
    fast = new_detokenizer(tok, prompt, skip, [], False)
    assert isinstance(fast, FastIncrementalDetokenizer)
    texts, _ = stream(fast, out, None if chunks is None else random.Random(chunks))
    assert texts[-1] == expect
    assert all(expect.startswith(t) for t in texts)  # pieces only append, never rewrite
    slow = IncrementalDetokenizer(tok, prompt, skip, [], False)
    assert stream(slow, out, None if chunks is None else random.Random(chunks))[0][-1] == expect


def real_ids(tok, rng: random.Random, n: int, anywhere: bool = True) -> list[int]:
    """`n` tokens of real text: from anywhere (possibly inside a character), or from its start
    to the end of a character."""
    ids = tok.encode(" ".join(rng.sample(TEXTS, len(TEXTS))), add_special_tokens=False)
    if anywhere:
        start = rng.randrange(len(ids) - n)
        return ids[start : start + n]
    while tok.decode(ids[:n]).endswith("\ufffd"):
        n += 1
    return ids[:n]


def test_the_default_tokenizer_takes_the_fast_path(smollm, sp_tok):
    assert decode_stream_backend(smollm) is smollm._tokenizer
    assert decode_stream_backend(sp_tok) is sp_tok._tokenizer


@pytest.mark.parametrize("skip", [True, False])
def test_real_text_streams_to_decode_of_the_output(smollm, skip):
    rng = random.Random(1)
    for _ in range(60):
        prompt, out = real_ids(smollm, rng, 12), real_ids(smollm, rng, rng.randint(1, 40))
        if rng.random() < 0.5:
            out = out[:5] + [smollm.eos_token_id, 1] + out[5:]  # special tokens in the output
        assert_streams(smollm, prompt, out, skip, smollm.decode(out, skip_special_tokens=skip),
                       rng.choice([None, rng.randrange(99)]))


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_stream_to_decode_of_the_output(smollm, skip):
    """Any ids, split characters and special tokens included: byte-level BPE decodes the output
    the same after the prompt as alone, so the text is decode(output ids) exactly."""
    rng = random.Random(2)
    for _ in range(200):
        prompt = [rng.randrange(len(smollm)) for _ in range(rng.randint(0, 8))]
        out = [rng.randrange(len(smollm)) for _ in range(rng.randint(1, 30))]
        assert_streams(smollm, prompt, out, skip, smollm.decode(out, skip_special_tokens=skip),
                       rng.choice([None, rng.randrange(99)]))


def test_an_emoji_split_over_tokens_waits_for_its_last_byte(smollm):
    out = smollm.encode(" 😀!", add_special_tokens=False)
    assert len(out) >= 3  # the emoji's bytes span tokens
    det = new_detokenizer(smollm, smollm.encode("Hi"), True, [], False)
    texts, _ = stream(det, out)
    assert texts[:len(out)] == ["", " 😀", " 😀!"]


def test_special_tokens_kept_or_skipped(smollm):
    out = smollm.encode("Hello", add_special_tokens=False) + [smollm.eos_token_id]
    for skip, expect in ((True, "Hello"), (False, "Hello<|im_end|>")):
        det = new_detokenizer(smollm, [1, 2], skip, [], False)
        assert stream(det, out)[0][-1] == expect


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_real_text_continues_the_prompt(sp_tok, skip):
    """The first output token keeps its "▁" as a space after the prompt, as in vLLM (decode of
    the output alone would strip it); emoji and CJK come through byte-fallback pieces. Outputs
    start and end on a character (a byte-fallback run cut in two decodes to U+FFFD as a whole,
    so such text is not monotonic: see the random-ids test)."""
    rng = random.Random(3)
    for _ in range(60):
        prompt = real_ids(sp_tok, rng, 10)
        out = real_ids(sp_tok, rng, rng.randint(1, 40), anywhere=False)
        assert_streams(sp_tok, prompt, out, skip, in_context(sp_tok, prompt, out, skip),
                       rng.choice([None, rng.randrange(99)]))


def test_sentencepiece_first_token_keeps_its_space(sp_tok):
    prompt = sp_tok.encode("The capital is", add_special_tokens=False)
    out = sp_tok.encode("Paris 😀", add_special_tokens=False)
    det = new_detokenizer(sp_tok, prompt, True, [], False)
    assert stream(det, out)[0][-1] == " Paris 😀"
    det = new_detokenizer(sp_tok, [], True, [], False)  # no prompt: as decode() has it
    assert stream(det, out)[0][-1] == "Paris 😀" == sp_tok.decode(out)


@pytest.mark.parametrize("tok_name", ["smollm", "legacy", "metaspace"])
def test_fast_and_generic_paths_agree_on_random_ids_and_stops(tok_name, request):
    """Random ids (on byte fallback: decoders whose text is not monotonic, where DecodeStream
    raises and the fast path goes on with the generic algorithm) and random stop strings."""
    tok = request.getfixturevalue(tok_name) if tok_name == "smollm" \
        else build_byte_fallback_tokenizer(tok_name)
    rng = random.Random(4)
    fell_back = 0
    for _ in range(300):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 8))]
        out = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        skip, include = rng.random() < 0.5, rng.random() < 0.5
        full = tok.decode(out, skip_special_tokens=skip)
        stop = []
        if len(full) > 2 and rng.random() < 0.7:
            i = rng.randrange(len(full) - 1)
            stop = [full[i : i + rng.randint(1, 4)], "never-there"]
        seed = rng.random()
        fast = new_detokenizer(tok, prompt, skip, stop, include)
        results = [stream(det, out, random.Random(seed)) for det in
                   (fast, IncrementalDetokenizer(tok, prompt, skip, stop, include))]
        assert results[0] == results[1]
        fell_back += fast.stream is None and results[0][1] is not None
    assert tok_name == "smollm" or fell_back  # some streams did take the error path


def test_stop_string_straddling_tokens(smollm):
    out = smollm.encode(" The answer is forty-two. Done", add_special_tokens=False)
    assert smollm.convert_ids_to_tokens(out)[3:6] == ["Ġforty", "-", "two"]
    for include, expect in ((False, " The answer is fort"), (True, " The answer is forty-tw")):
        det = new_detokenizer(smollm, [1], True, ["never", "y-tw"], include)
        texts, stop = stream(det, out)
        assert stop == "y-tw" and det.text == expect
        assert texts[-2] == " The answer is forty-"  # nothing stopped before "two" came


def test_decode_stream_error_falls_back_to_the_generic_path(sp_tok):
    """A byte run that turns invalid later makes DecodeStream raise ('invalid prefix'): the
    request goes on, with the same text as the generic path."""
    byte = {b: sp_tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0x48, 0xFF)}
    out = [byte[0x48], byte[0xFF], sp_tok.convert_tokens_to_ids("a")]
    det = new_detokenizer(sp_tok, [], True, [], False)
    fast = stream(det, out)
    assert det.stream is None  # it did fall back
    assert fast == stream(IncrementalDetokenizer(sp_tok, [], True, [], False), out)


def test_a_tokenizer_whose_decode_cleans_up_spaces_keeps_the_generic_path(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    assert isinstance(new_detokenizer(tok, [], True, [], False), FastIncrementalDetokenizer)
    tok = load_tokenizer(tiny_model_dir)
    tok.clean_up_tokenization_spaces = True
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    out = tok.encode("a . b", add_special_tokens=False)
    assert tok.decode(out) == "a. b" != tok._tokenizer.decode(out)
    assert type(new_detokenizer(tok, [], True, [], False)) is IncrementalDetokenizer


def test_the_slow_tokenizer_path(smollm):
    class Slow:
        is_fast = False

        def decode(self, ids, skip_special_tokens=False):
            return smollm.decode(ids, skip_special_tokens=skip_special_tokens)

    out = smollm.encode(TEXTS[1], add_special_tokens=False)
    det = new_detokenizer(Slow(), [], True, [], False)
    assert type(det) is IncrementalDetokenizer and stream(det, out)[0][-1] == TEXTS[1]
