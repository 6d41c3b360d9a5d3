"""block_hashes: chained over full blocks, keyed by extra_keys, stable across processes, and equal
to what the KV cache manager registers in the prefix cache for the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvserve.engine.core.block_hash import block_hashes, block_hashes_bytes, hash_block
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.sample.sampling_params import SamplingParams

TOKENS = [(i * 37 + 11) % 50_000 for i in range(70)]  # 4 full blocks of 16 + 6 tokens

_CHILD = """
import json, sys
from kvserve.engine.core.block_hash import block_hashes
cases = json.loads(sys.argv[1])
print(json.dumps([block_hashes(t, bs, None if k is None else tuple(k) if isinstance(k, list)
                               else k) for t, bs, k in cases]))
"""

_CHILD_SET = """
from kvserve.engine.core.block_hash import block_hashes
print(block_hashes(list(range(32)), 16, frozenset({"tenant-a", "tenant-b", "lora-7", "x"}))[0])
"""


def _in_subprocess(code: str, *args: str, hash_seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    res = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return res.stdout.strip()


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(TOKENS, 16)) == 4
    assert len(block_hashes(TOKENS[:64], 16)) == 4
    assert len(block_hashes(TOKENS[:63], 16)) == 3
    assert block_hashes(TOKENS[:15], 16) == []
    assert block_hashes([], 16) == []
    # A trailing partial block never changes the full blocks' hashes.
    assert block_hashes(TOKENS[:64] + [1, 2, 3], 16) == block_hashes(TOKENS[:64], 16)


def test_hashes_are_hex_blake2b_128():
    hs = block_hashes(TOKENS, 16)
    assert all(len(h) == 32 and int(h, 16) >= 0 for h in hs)
    assert len(set(hs)) == len(hs)
    assert [bytes.fromhex(h) for h in hs] == block_hashes_bytes(TOKENS, 16)


def test_each_hash_depends_on_the_whole_parent_chain():
    base = block_hashes(TOKENS, 16)
    changed = list(TOKENS)
    changed[3] += 1  # a token of the first block
    other = block_hashes(changed, 16)
    assert all(a != b for a, b in zip(base, other))  # every later block differs too
    changed = list(TOKENS)
    changed[40] += 1  # a token of the third block
    other = block_hashes(changed, 16)
    assert other[:2] == base[:2] and other[2] != base[2] and other[3] != base[3]


def test_same_block_under_another_parent_hashes_differently():
    block = TOKENS[16:32]
    assert hash_block(None, block) != hash_block(hash_block(None, TOKENS[:16]), block)
    # Two prompts sharing only their second block share no hash at all.
    a = block_hashes(TOKENS[:32], 16)
    b = block_hashes([0] * 16 + TOKENS[16:32], 16)
    assert a[1] != b[1]


def test_chain_continues_from_a_parent():
    full = block_hashes_bytes(TOKENS, 16)
    tail = block_hashes_bytes(TOKENS[32:], 16, parent=full[1])
    assert tail == full[2:]


def test_extra_keys_separate_the_chains():
    plain = block_hashes(TOKENS, 16)
    salted = block_hashes(TOKENS, 16, "salt-a")
    assert len(salted) == len(plain)
    assert set(salted).isdisjoint(plain)
    assert set(salted).isdisjoint(block_hashes(TOKENS, 16, "salt-b"))
    assert salted == block_hashes(TOKENS, 16, "salt-a")
    assert block_hashes(TOKENS, 16, ("lora", 3)) != block_hashes(TOKENS, 16, ("lora", 4))


def test_block_size_changes_the_hashes():
    assert block_hashes(TOKENS, 8)[1] != block_hashes(TOKENS, 16)[0]
    assert len(block_hashes(TOKENS, 8)) == 8


def test_stable_across_processes_with_different_hash_seeds():
    cases = [[TOKENS, 16, None], [TOKENS, 8, "salt"], [TOKENS[:40], 16, ["lora", 3]]]
    here = [block_hashes(t, bs, None if k is None else tuple(k) if isinstance(k, list) else k)
            for t, bs, k in cases]
    for seed in ("0", "12345"):
        assert json.loads(_in_subprocess(_CHILD, json.dumps(cases), hash_seed=seed)) == here


def test_set_valued_extra_keys_are_stable_across_processes():
    # A set's iteration order follows the per-process string hash seed; the hash must not.
    outs = {_in_subprocess(_CHILD_SET, hash_seed=seed) for seed in ("1", "2", "3", "4")}
    assert len(outs) == 1


def _seq(seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(), cache_salt=salt)


def _compute(kv: KVCacheManager, seq: Sequence) -> None:
    """What the engine does for a prefill: allocate, advance, register."""
    assert kv.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.register_computed(seq)


def test_kv_cache_manager_registers_the_public_hashes():
    kv = KVCacheManager(num_blocks=16, block_size=16)
    _compute(kv, _seq(1, TOKENS))
    stored = [h for e in kv.pool.drain_events() if e.kind == "stored" for h in e.block_hashes]
    assert stored == block_hashes(TOKENS, 16)
    assert sorted(kv.pool.cached_hashes()) == sorted(block_hashes(TOKENS, 16))


def test_kv_cache_manager_registers_salted_hashes_with_the_salt():
    kv = KVCacheManager(num_blocks=16, block_size=16)
    _compute(kv, _seq(1, TOKENS, salt="tenant-a"))
    assert sorted(kv.pool.cached_hashes()) == sorted(block_hashes(TOKENS, 16, "tenant-a"))
    # Another tenant's identical prompt finds nothing; the same tenant finds all full blocks.
    assert kv.lookup_prefix(_seq(2, TOKENS, salt="tenant-b")) == []
    assert len(kv.lookup_prefix(_seq(3, TOKENS, salt="tenant-a"))) == 4


def test_hash_is_blake2b_of_parent_tokens_and_key():
    # The documented definition, recomputed independently: H(parent, little-endian int32 ids, key).
    import hashlib
    import struct

    from kvserve.engine.core.block_hash import ROOT_HASH

    first = hashlib.blake2b(ROOT_HASH + struct.pack("<16i", *TOKENS[:16]) + b"'salt'",
                            digest_size=16).digest()
    second = hashlib.blake2b(first + struct.pack("<16i", *TOKENS[16:32]) + b"'salt'",
                             digest_size=16).digest()
    assert block_hashes(TOKENS[:32], 16, "salt") == [first.hex(), second.hex()]


def test_container_extra_keys_do_not_depend_on_insertion_order():
    a = block_hashes(TOKENS, 16, {"tenant": "a", "lora": 3})
    assert a == block_hashes(TOKENS, 16, {"lora": 3, "tenant": "a"})
    assert a != block_hashes(TOKENS, 16, {"lora": 4, "tenant": "a"})
    assert block_hashes(TOKENS, 16, {"x", "y"}) == block_hashes(TOKENS, 16, {"y", "x"})
    assert block_hashes(TOKENS, 16, {"x", "y"}) != block_hashes(TOKENS, 16, ("x", "y"))
    from typing import NamedTuple

    class Key(NamedTuple):
        tenant: str
        lora: int

    assert block_hashes(TOKENS, 16, Key("a", 3)) == block_hashes(TOKENS, 16, ("a", 3))


def test_unstable_extra_keys_are_rejected():
    class Tenant:  # its repr holds a memory address, different in every process
        pass

    with pytest.raises(TypeError, match="stable across processes"):
        block_hashes(TOKENS, 16, Tenant())


@pytest.mark.parametrize("extra", [None, "salt", {"tenant": {3, 1, 2}}])
@pytest.mark.parametrize("n", [0, 15, 16, 17, 100 * 16 + 5])
def test_the_chain_is_hash_block_block_by_block(n, extra):
    # block_hashes_bytes packs the tokens once; hash_block is the definition, one block at a time.
    tokens = [(i * 7919) % 49152 for i in range(n)]
    for parent in (None, b"p" * 16):
        want, prev = [], parent
        for start in range(0, n - 15, 16):
            prev = hash_block(prev, tokens[start : start + 16], extra)
            want.append(prev)
        assert block_hashes_bytes(tokens, 16, extra, parent=parent) == want
