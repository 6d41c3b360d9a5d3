"""Input validation for every backend: a KernelInputError naming the argument, before any launch."""

from __future__ import annotations

import math

import torch

from kvserve.kernels.fp8 import FP8_DTYPE

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8_DTYPE)
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("auto", "cpu", "torch", "triton", "reference")


class KernelInputError(ValueError):
    """Bad input to a kernel; `argument` names the offending parameter."""

    def __init__(self, argument: str, problem: str) -> None:
        super().__init__(f"{argument}: {problem}")
        self.argument = argument


def host_readable(t: torch.Tensor) -> bool:
    """Whether reading t's values on the host is free: a CPU tensor. A device's values are not
    read back in a step (a sync that idles the GPU, and illegal while a CUDA graph captures);
    tests/unit/engine/worker/test_step_host_sync.py swaps this to mark stand-in device tensors."""
    return t.device.type == "cpu"


def require(ok: bool, argument: str, problem: str) -> None:
    if not ok:
        raise KernelInputError(argument, problem)


def check_scale(value: float, argument: str) -> None:
    require(_scale_ok(value), argument,
            f"must be a finite positive float, got {value!r}")


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    require(k_cache.dim() == 4, "k_cache",
            f"expected [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)}")
    require(v_cache.shape == k_cache.shape, "v_cache",
            f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    require(k_cache.dtype in CACHE_DTYPES, "k_cache", f"unsupported dtype {k_cache.dtype}")
    require(v_cache.dtype == k_cache.dtype, "v_cache",
            f"dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    require(v_cache.device == k_cache.device, "v_cache", "is on another device than k_cache")
    # Blocks may lie a page apart (a KV region shared by models, engine/worker/kv_region.py);
    # within a block the layout is dense.
    dense = (k_cache.shape[2] * k_cache.shape[3], k_cache.shape[3], 1)
    require(k_cache.stride()[1:] == dense and v_cache.stride() == k_cache.stride(), "k_cache",
            "k_cache and v_cache must be contiguous (or dense blocks with one block stride)")


def check_index(t: torch.Tensor, argument: str, dim: int, device: torch.device) -> None:
    require(t.dim() == dim, argument, f"expected {dim} dimension(s), got shape {tuple(t.shape)}")
    require(t.dtype in INDEX_DTYPES, argument, f"expected int32 or int64, got {t.dtype}")
    require(t.device == device, argument, f"is on {t.device}, the caches on {device}")


def _scale_ok(value: float) -> bool:
    return isinstance(value, (int, float)) and 0 < value < math.inf


def _caches_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (k_cache.dim() == 4 and v_cache.shape == k_cache.shape
            and k_cache.dtype in CACHE_DTYPES and v_cache.dtype == k_cache.dtype
            and v_cache.device == k_cache.device and k_cache.is_contiguous()
            and v_cache.is_contiguous())


def _index_ok(t: torch.Tensor, dim: int, device: torch.device) -> bool:
    return t.dim() == dim and t.dtype in INDEX_DTYPES and t.device == device


def check_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float,
                   v_scale: float) -> None:
    """Shapes, dtypes, devices, scales and the slot range of a write_kv call."""
    device = k_cache.device
    if (_caches_ok(k_cache, v_cache) and key.dim() == 3 and value.shape == key.shape
            and key.shape[1:] == k_cache.shape[2:] and key.device == device
            and value.device == device and _index_ok(slot_mapping, 1, device)
            and slot_mapping.shape[0] == key.shape[0] and _scale_ok(k_scale)
            and _scale_ok(v_scale)):
        _check_slot_range(slot_mapping, k_cache)  # the fast path: every check above passed
        return
    check_caches(k_cache, v_cache)
    require(key.dim() == 3, "key",
            f"expected [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)}")
    require(value.shape == key.shape, "value",
            f"shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    require(key.shape[1:] == k_cache.shape[2:], "key",
            f"heads/head_dim {tuple(key.shape[1:])} differ from the cache's "
            f"{tuple(k_cache.shape[2:])}")
    require(key.device == k_cache.device and value.device == k_cache.device, "key",
            "key, value and the caches must be on one device")
    check_index(slot_mapping, "slot_mapping", 1, k_cache.device)
    require(slot_mapping.shape[0] == key.shape[0], "slot_mapping",
            f"has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    check_scale(k_scale, "k_scale")
    check_scale(v_scale, "v_scale")
    _check_slot_range(slot_mapping, k_cache)


def _check_slot_range(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Slots past the pool are refused on the CPU. A device's slots are not read back (a host
    sync per layer, and illegal while a CUDA graph captures): the engine checks them on the host
    before the copy (ModelRunner.to_device)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel() and host_readable(slot_mapping):
        top = int(slot_mapping.max())
        require(top < num_slots, "slot_mapping", f"slot {top} is past the pool's {num_slots} slots")


def check_layer_options(sliding_window: int | None, logits_soft_cap: float | None,
                        sinks: torch.Tensor | None = None, q: torch.Tensor | None = None) -> None:
    """The per-layer attention options: a window of at least one key, a finite positive cap,
    one finite float sink logit per query head on q's device."""
    if sliding_window is not None:
        require(isinstance(sliding_window, int) and not isinstance(sliding_window, bool)
                and sliding_window >= 1, "sliding_window",
                f"must be None or an int >= 1, got {sliding_window!r}")
    if logits_soft_cap is not None:
        check_scale(logits_soft_cap, "logits_soft_cap")
    if sinks is not None:
        require(isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.is_floating_point()
                and (q is None or (sinks.shape[0] == q.shape[1] and sinks.device == q.device)),
                "sinks", "expected a float tensor [num_heads] on the query's device, got "
                f"{getattr(sinks, 'shape', sinks)!r}")
        if host_readable(sinks):  # a device's are checked at load (Attention.load_sinks)
            require(bool(torch.isfinite(sinks).all()), "sinks", "must be finite")


def check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, k_scale: float,
                    v_scale: float, backend: str) -> None:
    """Everything about a paged_attention call that needs no look at the index values.

    One boolean expression first (the hot path: 30 calls per step); only when it fails do the
    checks below run one by one to name the argument (building no message on the way).
    """
    device = k_cache.device
    if (backend in BACKENDS and _caches_ok(k_cache, v_cache) and q.dim() == 3
            and q.dtype in QUERY_DTYPES and q.device == device and q.shape[2] == k_cache.shape[3]
            and q.shape[1] % k_cache.shape[2] == 0 and _index_ok(block_tables, 2, device)
            and _index_ok(seq_lens, 1, device) and _index_ok(query_start_loc, 1, device)
            and seq_lens.shape[0] == block_tables.shape[0]
            and query_start_loc.shape[0] == seq_lens.shape[0] + 1 and _scale_ok(scale)
            and _scale_ok(k_scale) and _scale_ok(v_scale)):
        return
    require(backend in BACKENDS, "backend", f"expected one of {BACKENDS}, got {backend!r}")
    check_caches(k_cache, v_cache)
    require(q.dim() == 3, "q", f"expected [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    require(q.dtype in QUERY_DTYPES, "q", f"unsupported dtype {q.dtype}")
    require(q.device == k_cache.device, "q", f"is on {q.device}, the caches on {k_cache.device}")
    require(q.shape[2] == k_cache.shape[3], "q",
            f"head_dim {q.shape[2]} differs from the cache's {k_cache.shape[3]}")
    require(q.shape[1] % k_cache.shape[2] == 0, "q",
            f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}")
    check_index(block_tables, "block_tables", 2, k_cache.device)
    check_index(seq_lens, "seq_lens", 1, k_cache.device)
    check_index(query_start_loc, "query_start_loc", 1, k_cache.device)
    require(seq_lens.shape[0] == block_tables.shape[0], "seq_lens",
            f"{seq_lens.shape[0]} sequences but block_tables has {block_tables.shape[0]} rows")
    require(query_start_loc.shape[0] == seq_lens.shape[0] + 1, "query_start_loc",
            f"expected num_seqs + 1 = {seq_lens.shape[0] + 1} entries, "
            f"got {query_start_loc.shape[0]}")
    check_scale(scale, "scale")
    check_scale(k_scale, "k_scale")
    check_scale(v_scale, "v_scale")


def check_new_kv(key: torch.Tensor | None, value: torch.Tensor | None, q: torch.Tensor,
                 k_cache: torch.Tensor) -> None:
    """paged_attention's `key`/`value`: both given, one row per query token, the cache's heads."""
    require(key is not None and value is not None, "key",
            "key and value are passed together (the step's new K/V) or not at all")
    want = (q.shape[0], k_cache.shape[2], k_cache.shape[3])
    for name, t in (("key", key), ("value", value)):
        require(tuple(t.shape) == want, name, f"expected shape {want}, got {tuple(t.shape)}")
        require(t.device == q.device, name, f"is on {t.device}, q on {q.device}")
        require(t.dtype in QUERY_DTYPES, name, f"unsupported dtype {t.dtype}")
