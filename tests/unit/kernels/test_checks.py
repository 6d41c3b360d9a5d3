"""Bad input: a ValueError naming the argument, raised before any kernel launch."""

from dataclasses import replace

import pytest
import torch

from kv_batches import Spec, build_batch
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.write_kv import write_kv
from kvserve.kernels.checks import KernelInputError
from kvserve.kernels.plan import plan_attention

SPEC = Spec(seqs=((20, 1), (9, 9)), num_kv_heads=2, group=2, head_dim=64, block_size=8,
            cache_dtype=torch.float32, q_dtype=torch.float32, seed=0)


def bad_attention_inputs():
    b = build_batch(SPEC)
    i32 = torch.int32
    past_pool = b.block_tables.clone()
    past_pool[0, 1] = b.k_cache.shape[0]
    negative = b.block_tables.clone()
    negative[1, 0] = -1
    return [
        ("q", replace(b, q=b.q[:, :, :32])),
        ("q", replace(b, q=torch.randn(10, 3, 64))),
        ("q", replace(b, q=b.q[:-1])),
        ("q", replace(b, q=b.q.to(torch.int32))),
        ("v_cache", replace(b, v_cache=b.v_cache[:-1])),
        ("v_cache", replace(b, v_cache=b.v_cache.half())),
        ("k_cache", replace(b, k_cache=b.k_cache[0], v_cache=b.v_cache[0])),
        ("block_tables", replace(b, block_tables=past_pool)),
        ("block_tables", replace(b, block_tables=negative)),
        ("block_tables", replace(b, block_tables=b.block_tables[:, :2])),
        ("block_tables", replace(b, block_tables=b.block_tables.float())),
        ("seq_lens", replace(b, seq_lens=torch.tensor([20], dtype=i32))),
        ("seq_lens", replace(b, seq_lens=torch.tensor([20, 8], dtype=i32))),
        ("query_start_loc", replace(b, query_start_loc=torch.tensor([0, 10], dtype=i32))),
        ("query_start_loc", replace(b, query_start_loc=torch.tensor([1, 2, 10], dtype=i32))),
        ("query_start_loc", replace(b, query_start_loc=torch.tensor([0, 5, 4], dtype=i32))),
        ("scale", replace(b, scale=-1.0)),
        ("k_scale", replace(b, k_scale=0.0)),
        ("v_scale", replace(b, v_scale=float("nan"))),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_bad_attention_input_names_the_argument(backend):
    # triton on CPU tensors without the interpreter would fail at launch: the check comes first.
    for argument, batch in bad_attention_inputs():
        with pytest.raises(KernelInputError) as err:
            paged_attention(*batch.args(), backend=backend)
        assert err.value.argument == argument, (argument, str(err.value))
        assert isinstance(err.value, ValueError) and str(err.value).startswith(argument)


def test_unknown_backend():
    b = build_batch(SPEC)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(*b.args(), backend="cuda")


def test_plan_checks_its_own_arguments():
    b = build_batch(SPEC)
    with pytest.raises(KernelInputError, match="max_seq_len"):
        plan_attention(b.block_tables, b.seq_lens, b.query_start_loc, 8, max_seq_len=10)
    with pytest.raises(KernelInputError, match="block_size"):
        plan_attention(b.block_tables, b.seq_lens, b.query_start_loc, 0)
    plan = plan_attention(b.block_tables, b.seq_lens, b.query_start_loc, 16)
    with pytest.raises(KernelInputError, match="k_cache: block_size"):
        paged_attention(*b.args(), plan=plan)


def bad_write_inputs():
    k_cache, v_cache = torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64)
    key, value, slots = torch.randn(3, 2, 64), torch.randn(3, 2, 64), torch.tensor([0, 5, 9])
    return [
        ("value", (key, value[:2], k_cache, v_cache, slots)),
        ("key", (key[:, :1], value[:, :1], k_cache, v_cache, slots)),
        ("key", (key[0], value[0], k_cache, v_cache, slots)),
        ("slot_mapping", (key, value, k_cache, v_cache, slots[:2])),
        ("slot_mapping", (key, value, k_cache, v_cache, torch.tensor([0, 5, 32]))),
        ("slot_mapping", (key, value, k_cache, v_cache, slots.float())),
        ("v_cache", (key, value, k_cache, v_cache[:, :4], slots)),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_bad_write_input_names_the_argument_and_writes_nothing(backend):
    for argument, (key, value, k_cache, v_cache, slots) in bad_write_inputs():
        with pytest.raises(KernelInputError) as err:
            write_kv(key, value, k_cache, v_cache, slots, backend=backend)
        assert err.value.argument == argument, (argument, str(err.value))
        assert not k_cache.any() and not v_cache.any()
