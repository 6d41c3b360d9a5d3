"""KVRegion: two models' views of one page-major buffer. A page written through one model's view
is those bytes for the other (the pages are shared, the layouts are not); writes land in the
page their block id names and nowhere else; the torch attention path reads a page-strided cache
exactly as a contiguous copy of it; the CPU C++ kernel's contract is kept by routing around it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvserve.engine.worker.kv_region import KVRegion, page_bytes_for
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.write_kv import write_kv

sys.path.insert(0, str(Path(__file__).parents[2] / "kernels"))
from kv_batches import MIXED, build_batch  # noqa: E402

CPU = torch.device("cpu")


def test_the_page_is_the_largest_block_rounded_to_the_alignment():
    assert page_bytes_for([1000, 4096, 300]) == 4096
    assert page_bytes_for([100]) == 128
    with pytest.raises(ValueError, match="multiple of 64"):
        KVRegion(2, 100, CPU)


def test_a_view_names_the_same_bytes_page_by_page_and_refuses_a_block_too_big():
    region = KVRegion(6, page_bytes_for([2 * 4 * 4 * 2 * 8 * 4]), CPU)
    big = region.view(4, 4, 2, 8, torch.float32)  # fills the page
    small = region.view(1, 4, 2, 8, torch.float32)  # a quarter of it
    assert big.shape == (2, 4, 6, 4, 2, 8) and small.shape == (2, 1, 6, 4, 2, 8)
    big[0, 0, 3].fill_(7.0)  # page 3's first quarter, through the big view
    assert torch.all(small[0, 0, 3] == 7.0) and small[:, :, [0, 1, 2, 4, 5]].abs().sum() == 0
    with pytest.raises(ValueError, match="does not fit a page"):
        region.view(5, 4, 2, 8, torch.float32)


@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_writes_land_only_in_the_named_pages(backend):
    region = KVRegion(5, page_bytes_for([2 * 2 * 4 * 2 * 8 * 4]), CPU)
    view = region.view(1, 4, 2, 8, torch.float32)  # half of each page
    k, v = view[0, 0], view[1, 0]
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv(key, value, k, v, torch.tensor([5, -1, 17]), backend=backend)  # -1: padding
    assert torch.equal(k[1, 1], key[0]) and torch.equal(v[4, 1], value[2])
    assert int((region.data != 0).any(dim=1).sum()) == 2  # pages 1 and 4, nothing else
    assert torch.all(region.data[:, region.page_bytes // 2:] == 0)  # the unused halves


def test_attention_reads_a_page_strided_cache_as_its_contiguous_copy():
    batch = build_batch(MIXED)
    blocks, bs, heads, dim = batch.k_cache.shape
    region = KVRegion(blocks, page_bytes_for([2 * bs * heads * dim * 4]) + 64, CPU)
    view = region.view(1, bs, heads, dim, torch.float32)
    view[0, 0].copy_(batch.k_cache)
    view[1, 0].copy_(batch.v_cache)
    assert not view[0, 0].is_contiguous()
    args = list(batch.args())
    expected = paged_attention(*args, backend="torch")
    args[1], args[2] = view[0, 0], view[1, 0]
    assert torch.equal(paged_attention(*args, backend="torch"), expected)
