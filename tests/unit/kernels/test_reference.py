"""The oracle against an independent computation: contiguous SDPA with explicit causal masks."""

import torch
import torch.nn.functional as F

from kv_batches import Spec, build_batch
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.fp8 import FP8_DTYPE


def contiguous_attention(batch, group: int) -> torch.Tensor:
    """Per sequence: read its blocks in table order, then SDPA with the shifted causal mask."""
    outs = []
    bs = batch.k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.q[starts[s]:starts[s + 1]].float()
        blocks = [int(b) for b in batch.block_tables[s, : -(-seq_len // bs)]]
        k = torch.cat([batch.k_cache[b] for b in blocks]).float()[:seq_len] * batch.k_scale
        v = torch.cat([batch.v_cache[b] for b in blocks]).float()[:seq_len] * batch.v_scale
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        n = q.shape[0]
        mask = torch.ones(n, seq_len, dtype=torch.bool).tril(seq_len - n)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=batch.scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def test_reference_matches_contiguous_sdpa_on_a_mixed_batch():
    spec = Spec(seqs=((9, 1), (40, 40), (37, 5), (16, 16), (1, 1)), num_kv_heads=2, group=3,
                head_dim=64, block_size=8, cache_dtype=torch.float32, q_dtype=torch.float32,
                shared_blocks=1, seed=3)
    batch = build_batch(spec)
    out = paged_attention(*batch.args(), backend="reference")
    torch.testing.assert_close(out, contiguous_attention(batch, 3), atol=1e-5, rtol=1e-5)


def test_reference_dequantizes_fp8_with_the_scales():
    spec = Spec(seqs=((20, 1), (12, 4)), num_kv_heads=1, group=2, head_dim=64, block_size=16,
                cache_dtype=FP8_DTYPE, q_dtype=torch.float32, seed=5)
    batch = build_batch(spec)
    out = paged_attention(*batch.args(), backend="reference")
    torch.testing.assert_close(out, contiguous_attention(batch, 2), atol=1e-5, rtol=1e-5)


def test_a_new_token_does_not_see_later_tokens():
    """Changing the last key/value of a prefill changes only the last query's output."""
    spec = Spec(seqs=((10, 10),), num_kv_heads=1, group=1, head_dim=64, block_size=16,
                cache_dtype=torch.float32, q_dtype=torch.float32, seed=1)
    batch = build_batch(spec)
    before = paged_attention(*batch.args(), backend="reference")
    block = int(batch.block_tables[0, 0])
    batch.k_cache[block, 9] += 5.0
    batch.v_cache[block, 9] -= 3.0
    after = paged_attention(*batch.args(), backend="reference")
    torch.testing.assert_close(after[:9], before[:9])
    assert not torch.allclose(after[9], before[9])
