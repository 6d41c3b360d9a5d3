"""Disk tier layout and checksum, measured on this machine's file system: one file per block
(temp file + rename, as the disk tier writes) against one preallocated arena file (pwrite /
pread / mmap at slot offsets), and CRC-32 against blake2b-128 over a block's bytes.

    python bench/kv_disk_layout.py [--block-kib 720] [--blocks 400] [--dir /tmp]

The default block is the default model's fp32 block (16 tokens x 45 KiB). Reads hit the page
cache (the blocks were just written): what a disk tier re-reading its recent evictions sees.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import tempfile
import time
import zlib


def per_block_ms(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-kib", type=int, default=720)
    p.add_argument("--blocks", type=int, default=400)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    size, n = args.block_kib * 1024, args.blocks
    data = [os.urandom(size) for _ in range(8)]
    d = tempfile.mkdtemp(prefix="kv-layout-", dir=args.dir)
    try:
        rows = {
            "crc32": per_block_ms(lambda: [zlib.crc32(data[i % 8]) for i in range(n)], n),
            "blake2b-128": per_block_ms(
                lambda: [hashlib.blake2b(data[i % 8], digest_size=16).digest()
                         for i in range(n)], n)}

        def files_write() -> None:
            for i in range(n):
                final = f"{d}/{i:032x}.kvblock"
                with open(final + ".tmp", "wb") as f:
                    f.write(data[i % 8])
                os.replace(final + ".tmp", final)

        def files_read() -> None:
            for i in range(n):
                with open(f"{d}/{i:032x}.kvblock", "rb") as f:
                    f.readinto(bytearray(size))

        rows["files: write (tmp + rename)"] = per_block_ms(files_write, n)
        rows["files: read"] = per_block_ms(files_read, n)
        rows["files: unlink"] = per_block_ms(
            lambda: [os.unlink(f"{d}/{i:032x}.kvblock") for i in range(n)], n)
        fd = os.open(f"{d}/arena", os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, size * n)
        rows["arena: pwrite"] = per_block_ms(
            lambda: [os.pwrite(fd, data[i % 8], i * size) for i in range(n)], n)
        rows["arena: pread"] = per_block_ms(
            lambda: [os.preadv(fd, [bytearray(size)], i * size) for i in range(n)], n)
        mm = mmap.mmap(fd, size * n)
        rows["arena: mmap copy"] = per_block_ms(
            lambda: [bytearray(mm[i * size:(i + 1) * size]) for i in range(n)], n)
        mm.close()
        os.close(fd)
    finally:
        shutil.rmtree(d)
    for name, ms in rows.items():
        print(f"{name:28s} {ms:7.3f} ms / block of {args.block_kib} KiB")


if __name__ == "__main__":
    main()
