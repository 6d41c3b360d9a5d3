"""The KV disk tier's block file: a fixed header (magic, block key, layout digest, payload
length, CRC-32) followed by one host block's bytes. A file whose header or checksum does not match
what the reader expects is a miss, so a torn, corrupted, stale or foreign file never becomes KV.

The layout digest names the model and the cache layout (dtype, shape per block, block size), so a
directory kept across restarts is reused by the same model and layout and ignored by any other.
CRC-32 rather than a cryptographic hash: it catches every error burst up to 32 bits and random
damage with odds of 2^-32, which is the threat here (disks, torn writes), and it runs on the
engine step's read path several times faster than blake2b (docs/perf.md).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

MAGIC = b"KVSDISK2"  # 1 held 16-byte keys only: a KV-cache group's key did not fit
# A block's key, zero-padded: its 16-byte hash, or for the pages of a KV-cache group g >= 1 the
# hash and g's two bytes (kv_cache_groups.group_key), which are never both zero.
KEY_BYTES = 32
HEADER = struct.Struct(f"<8s{KEY_BYTES}s32sQI")  # magic, block key, layout digest, length, crc32
HEADER_SIZE = HEADER.size
SUFFIX = ".kvblock"


def layout_digest(layout: str) -> bytes:
    """32 bytes naming a model + cache layout (see `describe_layout`)."""
    return hashlib.blake2b(layout.encode(), digest_size=32).digest()


def describe_layout(model: str, revision: str | None, kv_dtype: str,
                    block_shape: tuple[int, ...], model_path: str | Path | None = None) -> str:
    """The model and block layout a file was written for. A local model folder adds its weight
    files' names, sizes and modification times, so weights replaced under the same name make
    the old files misses rather than wrong KV."""
    parts = [f"model={model}", f"revision={revision}", f"kv_dtype={kv_dtype}",
             f"block_shape={list(block_shape)}"]
    folder = Path(model_path) if model_path is not None else None
    if folder is not None and folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.suffix in (".safetensors", ".gguf", ".bin", ".pt"):
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return " ".join(parts)


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def key_fits(block_hash: bytes) -> bool:
    """Whether a block key fits the header (a hash of 16 bytes, or a group's key of 18)."""
    return 16 <= len(block_hash) <= KEY_BYTES


def header(block_hash: bytes, digest: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    if not key_fits(block_hash):
        raise ValueError(f"a block key of {len(block_hash)} bytes does not fit the disk block "
                         f"file's header (16 to {KEY_BYTES} bytes)")
    crc = zlib.crc32(payload, zlib.crc32(block_hash + digest))
    return HEADER.pack(MAGIC, block_hash, digest, len(payload), crc)


def header_matches(head: bytes, digest: bytes, payload_size: int) -> bool:
    """Whether a file's first bytes are a header of this layout (the scan at start-up)."""
    if len(head) < HEADER_SIZE:
        return False
    magic, _, d, n, _ = HEADER.unpack_from(head)
    return magic == MAGIC and d == digest and n == payload_size


def verify(head: bytes | bytearray, payload: bytearray, block_hash: bytes, digest: bytes,
           payload_size: int) -> bool:
    """Whether a file's header and payload are this block, of this layout, undamaged."""
    if len(head) != HEADER_SIZE or len(payload) != payload_size:
        return False
    magic, h, d, n, crc = HEADER.unpack_from(head)
    if magic != MAGIC or h != block_hash.ljust(KEY_BYTES, b"\0") or d != digest \
            or n != payload_size:
        return False
    return zlib.crc32(payload, zlib.crc32(block_hash + digest)) == crc
