"""DiskTier on a real directory: blocks written off the step come back byte for byte, a damaged,
missing or foreign file is a miss (never wrong bytes), the size cap holds in LRU order, the
directory is reused after a restart of the same layout, and bad settings are refused."""

from __future__ import annotations

import os
import random

import pytest

from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_offload import disk_block_file as fmt
from kvserve.engine.kv_offload.disk_tier import DiskTier

PAYLOAD = 256
FILE = fmt.HEADER_SIZE + PAYLOAD
LAYOUT = "model=tiny kv_dtype=torch.float32 block_shape=[2, 2, 16, 2, 16]"


def block(i: int) -> tuple[bytes, bytearray]:
    rng = random.Random(i)
    return i.to_bytes(16, "big"), bytearray(rng.randbytes(PAYLOAD))


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "kv", 4 * FILE, PAYLOAD, LAYOUT)
    yield t
    t.close()


def files(path) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(fmt.SUFFIX))


def test_blocks_come_back_verified_from_files(tier):
    blocks = [block(i) for i in range(3)]
    for h, p in blocks:
        assert tier.put(h, p)
    tier.flush()
    assert files(tier.path) == sorted(fmt.file_name(h) for h, _ in blocks)
    assert tier.read([h for h, _ in blocks]) == [p for _, p in blocks]
    assert tier.bytes_read == 3 * PAYLOAD and tier.counters.stored == 3
    assert [e.kind for e in tier.drain_events()] == ["stored"]


def test_a_queued_block_is_served_before_its_file_exists(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    t._ops.put(("stop", b"", 0))  # the writer stops: nothing reaches the disk
    t._writer.join()
    h, p = block(1)
    t.put(h, p)
    assert files(tmp_path) == [] and t.read([h]) == [p]
    t.close()


@pytest.mark.parametrize("offset", [3, 20, 40, fmt.HEADER_SIZE - 1, fmt.HEADER_SIZE + 100,
                                    FILE - 1])
def test_one_changed_byte_anywhere_is_a_miss(tier, offset):
    (h0, p0), (h1, p1), (h2, p2) = block(0), block(1), block(2)
    for h, p in ((h0, p0), (h1, p1), (h2, p2)):
        tier.put(h, p)
    tier.flush()
    path = tier.path / fmt.file_name(h1)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    assert tier.read([h0, h1, h2]) == [p0]  # the prefix ends at the damaged block
    assert h1 not in tier and tier.num_bad_files == 1
    tier.flush()
    assert not path.exists()  # a damaged file is deleted, not read again


def test_missing_and_truncated_files_are_misses(tier):
    (h0, p0), (h1, p1) = block(0), block(1)
    tier.put(h0, p0)
    tier.put(h1, p1)
    tier.flush()
    (tier.path / fmt.file_name(h0)).unlink()
    with open(tier.path / fmt.file_name(h1), "r+b") as f:
        f.truncate(FILE - 1)
    assert tier.read([h0]) == [] and tier.read([h1]) == []
    assert len(tier) == 0 and tier.num_bad_files == 2


def test_size_cap_holds_in_lru_order(tier):
    assert tier.num_blocks == 4
    blocks = [block(i) for i in range(7)]
    for h, p in blocks[:4]:
        tier.put(h, p)
    assert tier.read([blocks[0][0]]) == [blocks[0][1]]  # block 0 becomes most recent
    for h, p in blocks[4:]:
        tier.put(h, p)
    tier.flush()
    kept = [blocks[i][0] for i in (3, 0, 4, 5, 6)][-4:]
    assert tier.lru_hashes() == kept
    assert files(tier.path) == sorted(fmt.file_name(h) for h in kept)
    on_disk = sum(os.path.getsize(tier.path / f) for f in files(tier.path))
    assert on_disk <= 4 * FILE
    assert tier.counters.evicted == 3


def test_a_full_writer_queue_drops_blocks(tmp_path):
    t = DiskTier(tmp_path, 8 * FILE, PAYLOAD, LAYOUT, queue_bytes=2 * PAYLOAD)
    t._ops.put(("stop", b"", 0))
    t._writer.join()
    stored = [t.put(*block(i)) for i in range(3)]
    assert stored == [True, True, False] and t.num_dropped == 1 and len(t) == 2
    t.close()


def test_restart_reuses_the_files_of_the_same_layout(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    blocks = [block(i) for i in range(3)]
    for h, p in blocks:
        t.put(h, p)
    t.close()
    (tmp_path / "leftover.kvblock.tmp").write_bytes(b"torn")
    (tmp_path / "notes.txt").write_bytes(b"not ours")
    again = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    assert sorted(again.lru_hashes()) == sorted(h for h, _ in blocks)
    assert again.read([h for h, _ in blocks]) == [p for _, p in blocks]
    assert not (tmp_path / "leftover.kvblock.tmp").exists()
    assert (tmp_path / "notes.txt").exists()  # files that are not block files are left alone
    again.close()
    smaller = DiskTier(tmp_path, 2 * FILE, PAYLOAD, LAYOUT)  # the cap shrank: oldest go
    assert len(smaller) == 2 and len(files(tmp_path)) == 2
    smaller.close()


def test_files_of_another_model_or_layout_are_never_read(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    h, p = block(0)
    t.put(h, p)
    t.close()
    other = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT.replace("tiny", "other"))
    assert len(other) == 0 and other.read([h]) == [] and files(tmp_path) == []
    other.close()


def test_clear_deletes_every_block_file(tier):
    for i in range(3):
        tier.put(*block(i))
    tier.clear()
    tier.flush()
    assert len(tier) == 0 and files(tier.path) == []
    assert [e.kind for e in tier.drain_events()] == ["cleared"]


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds no KV block file"):
        DiskTier(tmp_path, FILE - 1, PAYLOAD, LAYOUT)
    (tmp_path / "a_file").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a writable directory"):
        DiskTier(tmp_path / "a_file" / "kv", 4 * FILE, PAYLOAD, LAYOUT)
    first = DiskTier(tmp_path / "kv", 4 * FILE, PAYLOAD, LAYOUT)
    with pytest.raises(ConfigError, match="in use by another kvserve engine"):
        DiskTier(tmp_path / "kv", 4 * FILE, PAYLOAD, LAYOUT)
    first.close()
    DiskTier(tmp_path / "kv", 4 * FILE, PAYLOAD, LAYOUT).close()  # released on close


def test_a_kv_cache_groups_key_is_served_kept_across_a_restart_and_cleared(tmp_path):
    # A hybrid model's pages of group g >= 1 are keyed by the hash and g (18 bytes): the file's
    # header holds the whole key, the restart scan indexes the file, and clear deletes it.
    (h, p), (g, q) = block(1), block(2)
    group_key = g + (3).to_bytes(2, "little")
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    assert t.put(h, p) and t.put(group_key, q)
    t.flush()
    assert t.read([h, group_key]) == [p, q] and t.bytes_read == 2 * PAYLOAD  # from the files
    assert t.read([g]) == [] and t.num_bad_files == 0  # the plain hash is another block
    t.close()
    again = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    assert sorted(again.lru_hashes()) == sorted([h, group_key])
    assert again.read([group_key]) == [q]
    again.clear()
    again.flush()
    assert files(tmp_path) == []
    with pytest.raises(ValueError, match="16 to 32 bytes .* not 33"):
        again.put(bytes(33), q)
    again.close()
