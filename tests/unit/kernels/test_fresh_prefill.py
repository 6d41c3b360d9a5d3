"""Fresh prefills through torch's attention on the step's new K/V (kernels/fresh_prefill.py), the
rest of the batch through the paged kernel: routing and numerics against the reference kernel,
the Triton kernel under TRITON_INTERPRET=1 on CPU tensors."""

import pytest
import torch
from conftest import triton_interpreted

from kv_batches import FP8, Spec, assert_close_to, build_batch
from kvserve.kernels import fresh_prefill
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.checks import KernelInputError
from kvserve.kernels.plan import plan_attention
from kvserve.kernels.reference import dequantize

# A fresh prompt, a decode, a chunked prefill over a cached prefix, a second fresh prompt, and
# a fresh one-token prompt (left to the kernel: one new token is a decode row's shape).
SEQS = ((37, 37), (70, 1), (64, 24), (21, 21), (1, 1))


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton_interpreted("kvserve.kernels.triton_attention") as (attention,):
        yield attention


def new_kv(batch, dtype):
    """Each sequence's new tokens' K/V read back from the cache: what the layer just wrote."""
    bs = batch.k_cache.shape[1]
    keys, values = [], []
    qsl = batch.query_start_loc.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        n = qsl[s + 1] - qsl[s]
        blocks = batch.block_tables[s, : -(-seq_len // bs)].long()
        for cache, scale, out in ((batch.k_cache, batch.k_scale, keys),
                                  (batch.v_cache, batch.v_scale, values)):
            rows = dequantize(cache[blocks], scale, torch.float32).flatten(0, 1)
            out.append(rows[seq_len - n: seq_len])
    return torch.cat(keys).to(dtype), torch.cat(values).to(dtype)


def spec(dtype, seqs=SEQS, group=3):
    return Spec(seqs=seqs, num_kv_heads=2, group=group, head_dim=64, block_size=16,
                cache_dtype=dtype, q_dtype=dtype if dtype != FP8 else torch.bfloat16,
                shared_blocks=1, seed=5)


def test_split_names_fresh_sequences_and_plans_the_rest():
    batch = build_batch(spec(torch.float32))
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    split = fresh_prefill.fresh_split(plan)
    assert split.fresh == [0, 3] and split.fresh_lens == [37, 21] and not split.all_fresh
    starts = batch.query_start_loc.tolist()
    assert split.fresh_tokens.tolist() == list(range(0, 37)) + list(range(starts[3], starts[4]))
    rest = split.rest_plan
    assert rest.seq_lens == [70, 64, 1] and rest.query_lens == [1, 24, 1]
    assert torch.equal(rest.block_tables, batch.block_tables[[1, 2, 4]])
    assert split.rest_tokens.tolist() == [37] + list(range(38, 62)) + [starts[4]]


@pytest.mark.parametrize("backend,dtype,options,expected", [
    ("triton", torch.bfloat16, False, True),
    ("triton", torch.float32, False, True),
    ("triton", FP8, False, False),  # the kernel reads rounded fp8 keys: keep one path
    ("triton", torch.bfloat16, True, False),  # a window / soft cap / sinks: the kernel
    ("reference", torch.float32, False, False),  # the oracle never routes
    ("cpu", torch.float32, False, False),  # the C++ kernel: not faster in fp32 (docs/perf/gpu.md)
    ("cpu", torch.bfloat16, False, True),
    ("torch", torch.float32, False, True),
    ("torch", FP8, False, False),
])
def test_route(backend, dtype, options, expected):
    batch = build_batch(spec(dtype))
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    assert fresh_prefill.route(plan, backend, dtype, True, options) is expected
    assert not fresh_prefill.route(plan, backend, dtype, False, options)


def test_decode_only_batch_never_routes():
    batch = build_batch(spec(torch.float32, seqs=((30, 1), (5, 1))))
    plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
    assert not fresh_prefill.route(plan, "triton", torch.float32, True, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [SEQS, ((37, 37), (21, 21))], ids=["mixed", "all-fresh"])
def test_matches_reference(dtype, seqs):
    batch = build_batch(spec(dtype, seqs))
    key, value = new_kv(batch, dtype)
    expected = paged_attention(*batch.args(), backend="reference")
    out = paged_attention(*batch.args(), backend="triton", key=key, value=value)
    assert_close_to(out, expected)


def test_fresh_rows_read_the_new_kv_and_the_rest_read_the_cache():
    """Perturb the given K/V: the fresh sequences' rows change, every other row does not."""
    batch = build_batch(spec(torch.float32))
    key, value = new_kv(batch, torch.float32)
    base = paged_attention(*batch.args(), backend="triton", key=key, value=value)
    other = paged_attention(*batch.args(), backend="triton", key=key * 3, value=value + 1)
    starts = batch.query_start_loc.tolist()
    fresh = torch.zeros(base.shape[0], dtype=torch.bool)
    fresh[0:37] = True
    fresh[starts[3]:starts[4]] = True
    assert (base[fresh] - other[fresh]).abs().amax() > 0.1
    assert torch.equal(base[~fresh], other[~fresh])


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("cpu", torch.bfloat16),
                                           ("cpu", torch.float32)])
def test_cpu_backends_match_reference(monkeypatch, backend, dtype):
    """The CPU backends with the routes they take (and the one they leave to the C++ kernel,
    forced through SDPA as bench/fresh_prefill_cpu.py does), against the reference."""
    monkeypatch.setattr(fresh_prefill, "CPU_BACKENDS", {backend: frozenset({dtype})})
    batch = build_batch(spec(dtype))
    key, value = new_kv(batch, dtype)
    expected = paged_attention(*batch.args(), backend="reference")
    assert_close_to(paged_attention(*batch.args(), backend=backend, key=key, value=value),
                    expected)


def test_long_prefill_tiles_without_mask(interpreter):
    """Prefills long enough for whole unmasked key tiles before the diagonal (block_n 16 in the
    interpreter), with a cached prefix and without, through the paged kernel alone."""
    batch = build_batch(spec(torch.float32, ((150, 150), (140, 70), (90, 1)), group=2))
    expected = paged_attention(*batch.args(), backend="reference")
    assert_close_to(paged_attention(*batch.args(), backend="triton"), expected)


def test_bad_new_kv_is_refused():
    batch = build_batch(spec(torch.float32))
    key, value = new_kv(batch, torch.float32)
    with pytest.raises(KernelInputError, match="key"):
        paged_attention(*batch.args(), backend="triton", key=key)
    with pytest.raises(KernelInputError, match="value"):
        paged_attention(*batch.args(), backend="triton", key=key, value=value[:-1])


def test_tiles_grow_on_hopper_only(interpreter):
    ampere = interpreter.tiles((8, 0), False, 128, 16)
    hopper = interpreter.tiles((9, 0), False, 128, 16)
    assert hopper.rows > ampere.rows and hopper.num_warps > ampere.num_warps
    assert interpreter.tiles((9, 0), False, 256, 16).rows == ampere.rows  # a wide head
    assert interpreter.tiles((9, 0), True, 128, 16) == interpreter.tiles((8, 0), True, 128, 16)
