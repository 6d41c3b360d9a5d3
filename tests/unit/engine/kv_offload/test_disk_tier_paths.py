"""DiskTier paths test_disk_tier.py leaves open (mutation survivors, see docs/mutation.md): clear
after the files are written, a block evicted and stored again while its first write waits, a
write that fails, the event batching, close, a full queue waited for, the figures of the
small-disk warning and of the refusals, a path with missing parents, the reuse log line, a
tier never closed at exit, and a lock on descriptor 0 (stdin closed)."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import replay_kv_events

from test_disk_tier import FILE, LAYOUT, PAYLOAD, block, files

from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_offload import disk_block_file as fmt
from kvserve.engine.kv_offload.disk_tier import DiskTier


def held_writer(t: DiskTier) -> threading.Event:
    """Hold the writer thread before its next operation until the returned event is set."""
    go, apply = threading.Event(), t._apply

    def wait_then_apply(*args):
        go.wait()
        apply(*args)

    t._apply = wait_then_apply
    return go


def test_clear_deletes_the_files_already_written(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    for i in range(3):
        t.put(*block(i))
    t.flush()
    assert len(files(tmp_path)) == 3
    (tmp_path / (fmt.file_name(block(9)[0]) + ".tmp")).write_bytes(b"torn")
    t.clear()
    t.flush()
    assert files(tmp_path) == [] and not list(tmp_path.glob("*.tmp"))
    t.close()


def test_a_block_stored_again_while_its_first_write_waits_is_written_once(tmp_path, caplog):
    # A one-block tier: h is queued, evicted by g, then stored again with other bytes, all
    # before the writer runs. The stale write and the unlink of a file never written are no-ops;
    # the file holds the second bytes and the block is then served from it.
    t = DiskTier(tmp_path, FILE, PAYLOAD, LAYOUT)
    go = held_writer(t)
    (h, first), (g, other) = block(1), block(2)
    second = bytearray(reversed(first))
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        t.put(h, first)
        t.put(g, other)
        t.put(h, second)
        go.set()
        t.flush()
    assert files(tmp_path) == [fmt.file_name(h)]
    assert t.read([h]) == [second] and t.bytes_read == PAYLOAD  # from the file, not memory
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    t.close()


def test_a_failed_write_frees_its_place_in_the_writer_queue(tmp_path, caplog):
    # The temporary file's name is taken by a directory: the write fails, the block is a miss
    # once read, and the queue (one block long) takes the next block.
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT, queue_bytes=PAYLOAD)
    (h, p), (g, q) = block(1), block(2)
    (tmp_path / (fmt.file_name(h) + ".tmp")).mkdir()
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        assert t.put(h, p)
        t.flush()
    assert any("write of block" in r.getMessage() for r in caplog.records)
    assert t.put(g, q) and t.num_dropped == 0
    t.flush()
    assert t.read([h]) == [] and t.num_bad_files == 1
    assert t.read([g]) == [q]
    t.close()


def test_drained_events_batch_only_consecutive_ones_of_a_kind(tmp_path):
    t = DiskTier(tmp_path, FILE, PAYLOAD, LAYOUT)  # one block: each put evicts the last
    hashes = [block(i)[0] for i in range(3)]
    for i in range(3):
        t.put(*block(i))
    got = [(e.kind, e.block_hashes) for e in t.drain_events()]
    assert got == [("stored", (hashes[0].hex(),)), ("removed", (hashes[0].hex(),)),
                   ("stored", (hashes[1].hex(),)), ("removed", (hashes[1].hex(),)),
                   ("stored", (hashes[2].hex(),))]
    assert t.drain_events() == []
    t.close()


def test_close_releases_the_directory_once(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    assert t.is_open
    t.put(*block(1))
    t.close()
    assert not t.is_open and files(tmp_path) == [fmt.file_name(block(1)[0])]
    t.close()  # a second close does nothing
    again = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)  # the lock was released
    assert again.is_open and len(again) == 1
    again.close()


def test_events_after_a_clear_batch_the_stores_that_follow(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    t.put(*block(0))
    t.clear()
    t.put(*block(1))
    t.put(*block(2))
    got = [(e.kind, e.block_hashes) for e in t.drain_events()]
    assert got == [("cleared", ()), ("stored", (block(1)[0].hex(), block(2)[0].hex()))]
    t.close()


def test_a_block_file_name_that_is_not_hex_is_left_alone_at_start(tmp_path):
    stray = tmp_path / ("zz" * 16 + fmt.SUFFIX)
    stray.write_bytes(b"not a block")
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    assert len(t) == 0 and stray.exists()
    t.close()


def test_a_writer_queue_below_one_block_still_takes_one(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT, queue_bytes=PAYLOAD // 2)
    go = held_writer(t)
    assert [t.put(*block(i)) for i in range(2)] == [True, False] and t.num_dropped == 1
    go.set()
    t.close()


def test_a_cap_over_the_free_space_is_warned_about_and_one_under_it_is_not(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        DiskTier(tmp_path / "small", 4 * FILE, PAYLOAD, LAYOUT).close()
        assert not caplog.records
        DiskTier(tmp_path / "huge", 1 << 60, PAYLOAD, LAYOUT).close()
    assert [r for r in caplog.records if "exceeds the free space" in r.getMessage()]


def test_usage_is_the_share_of_the_cap_in_use(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    assert t.usage() == 0.0
    for i in range(3):
        t.put(*block(i))
    assert t.usage() == 0.75
    t.close()


def test_a_failed_unlink_is_logged_and_the_writer_keeps_going(tmp_path, caplog):
    # h's file is replaced by a directory: reading h is a miss, and unlinking the bad "file"
    # fails. The failure is a warning; the writer thread lives on and writes the next block.
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    (h, p), (g, q) = block(1), block(2)
    t.put(h, p)
    t.flush()
    (tmp_path / fmt.file_name(h)).unlink()
    (tmp_path / fmt.file_name(h)).mkdir()
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        assert t.read([h]) == [] and h not in t
        t.flush()
    assert any(f"unlink of block {h.hex()} failed" in m.getMessage() for m in caplog.records)
    assert t._writer.is_alive()
    assert t.put(g, q)
    t.flush()
    assert t.read([g]) == [q] and t.bytes_read == PAYLOAD  # from g's file
    t.close()


def test_a_file_with_a_byte_past_its_payload_is_a_miss(tmp_path):
    # The header and payload verify; the extra byte shows the file is not what was written.
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    (h, p), (g, q) = block(1), block(2)
    t.put(h, p)
    t.put(g, q)
    t.flush()
    with open(tmp_path / fmt.file_name(h), "ab") as f:
        f.write(b"\0")
    assert t.read([h]) == [] and h not in t and t.num_bad_files == 1
    assert t.read([g]) == [q] and t.bytes_read == PAYLOAD
    t.close()


def test_bytes_written_counts_the_queued_blocks_not_the_dropped_or_repeated(tmp_path):
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT, queue_bytes=PAYLOAD)
    go = held_writer(t)
    (h, p), (g, q) = block(1), block(2)
    assert t.put(h, p) and t.put(h, p)  # the second is a hit: only made most recent
    assert not t.put(g, q) and t.num_dropped == 1  # the one-block queue is full
    go.set()
    t.flush()
    assert t.bytes_written == PAYLOAD
    assert t.put(g, q)
    t.flush()
    assert t.bytes_written == 2 * PAYLOAD
    t.close()


def test_an_undrained_event_backlog_stays_bounded_and_replays_to_the_index(tmp_path):
    # A one-block tier: each put stores one block and removes the last (two events). Undrained,
    # the log is compacted to a clear and the blocks held, so a replay ends at the index.
    t = DiskTier(tmp_path, FILE, PAYLOAD, LAYOUT)
    limit = 2 * t.num_blocks + 1024
    for i in range(limit):
        t.put(*block(i))
        assert len(t._events) <= limit
    t.flush()
    held = replay_kv_events(t.drain_events())
    assert held == {h.hex() for h in t.lru_hashes()} == {block(limit - 1)[0].hex()}
    t.close()


def test_an_unreadable_block_file_at_start_is_skipped_and_the_rest_are_indexed(tmp_path,
                                                                              monkeypatch):
    # A directory holds the first block file name (open fails). The scan goes on past it: listed
    # first (names in order), it must not hide the files after it.
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    blocks = [block(i) for i in (1, 2, 3)]
    for h, p in blocks:
        t.put(h, p)
    t.close()
    (tmp_path / fmt.file_name(block(0)[0])).mkdir()
    listed = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(listed(self))))
    again = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    assert sorted(again.lru_hashes()) == [h for h, _ in blocks]
    assert again.read([h for h, _ in blocks]) == [p for _, p in blocks]
    again.close()


@pytest.mark.parametrize("write_fails", [False, True])
def test_a_clear_while_the_first_write_runs_leaves_no_file_and_the_writer_goes_on(
        tmp_path, monkeypatch, write_fails):
    # The writer has taken h's bytes (the in-flight check passed) when the cache is reset; the
    # write then ends (or fails) with h no longer in flight, and the queued clear removes it.
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
    writing, go, header = threading.Event(), threading.Event(), fmt.header

    def held_header(*args):
        monkeypatch.setattr(fmt, "header", header)  # the first write only
        writing.set()
        go.wait()
        if write_fails:
            raise OSError(28, "No space left on device")
        return header(*args)

    monkeypatch.setattr(fmt, "header", held_header)
    (h, p), (g, q) = block(1), block(2)
    t.put(h, p)
    assert writing.wait(60)  # a guard against a hang, not a speed bound
    t.clear()
    go.set()
    # A writer that died would never drain the queued clear: fail (after a hang guard, not a
    # speed bound) rather than wait forever in flush().
    flusher = threading.Thread(target=t.flush, daemon=True)
    flusher.start()
    flusher.join(60)
    assert not flusher.is_alive(), "the writer thread stopped with operations queued"
    assert t._writer.is_alive() and files(tmp_path) == []
    assert t.put(g, q)
    t.flush()
    assert files(tmp_path) == [fmt.file_name(g)] and t.read([g]) == [q] and t.bytes_read == PAYLOAD
    t.close()


def test_a_full_writer_queue_is_waited_for_when_asked(tmp_path):
    # A one-block queue holds h. put(g, wait=True) waits for the writer (flush, which releases
    # the held writer here) and then takes g: nothing is dropped.
    t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT, queue_bytes=PAYLOAD)
    go, flush = held_writer(t), t.flush

    def release_then_flush():
        go.set()
        flush()

    t.flush = release_then_flush
    (h, p), (g, q) = block(1), block(2)
    assert t.put(h, p)
    assert t.put(g, q, wait=True) and t.num_dropped == 0
    t.flush()
    assert files(tmp_path) == sorted(fmt.file_name(x) for x in (h, g))
    assert t.read([h, g]) == [p, q] and t.bytes_read == 2 * PAYLOAD  # from the files
    t.close()


def _figures(message: str) -> tuple[float, float]:
    """The cap's and the free space's GiB figures of the small-disk warning."""
    m = re.search(r"the cap \(([\d.]+) GiB\) exceeds the free space in .* \(([\d.]+) GiB\)",
                  message)
    assert m, message
    return float(m[1]), float(m[2])


def test_the_small_disk_warning_quotes_the_cap_and_the_free_space_in_gib(tmp_path, caplog):
    # A cap of twice the free space (a margin for other writers to the disk meanwhile).
    free = shutil.disk_usage(tmp_path).free
    with caplog.at_level(logging.WARNING, logger="kvserve.engine"):
        t = DiskTier(tmp_path, 2 * free, PAYLOAD, LAYOUT)
    t.close()
    (warning,) = [r.getMessage() for r in caplog.records if "free space" in r.getMessage()]
    cap, quoted_free = _figures(warning)
    assert cap == round(t.num_blocks * FILE / (1 << 30), 1)
    assert abs(quoted_free - free / (1 << 30)) <= 0.25 * free / (1 << 30) + 0.05


def test_a_disk_size_below_one_block_file_is_refused_with_its_gib_figure(tmp_path):
    with pytest.raises(ConfigError, match=r"kv_offloading_disk_size 0\.5 GiB holds no KV block "
                                          rf"file of {fmt.HEADER_SIZE + (1 << 30)} bytes"):
        DiskTier(tmp_path, 1 << 29, 1 << 30, LAYOUT)


def test_an_unwritable_path_is_refused_with_the_system_reason(tmp_path):
    (tmp_path / "a_file").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"'\S+/a_file/kv' is not a writable directory "
                                          r"\(Not a directory\); pick another path"):
        DiskTier(tmp_path / "a_file" / "kv", 4 * FILE, PAYLOAD, LAYOUT)


def test_a_path_whose_parents_do_not_exist_yet_is_created(tmp_path):
    t = DiskTier(tmp_path / "cache" / "kv", 4 * FILE, PAYLOAD, LAYOUT)
    h, p = block(1)
    assert t.put(h, p)
    t.flush()
    assert files(tmp_path / "cache" / "kv") == [fmt.file_name(h)]
    t.close()


def test_a_restart_logs_the_files_it_reuses_and_a_fresh_directory_logs_nothing(tmp_path,
                                                                               caplog):
    with caplog.at_level(logging.INFO, logger="kvserve.engine"):
        t = DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT)
        assert not [r for r in caplog.records if "reusing" in r.getMessage()]
        for i in range(3):
            t.put(*block(i))
        t.close()
        DiskTier(tmp_path, 4 * FILE, PAYLOAD, LAYOUT).close()
    assert [r.getMessage() for r in caplog.records if "reusing" in r.getMessage()] == [
        f"KV disk tier: reusing 3 block files in {tmp_path}"]


def test_a_tier_never_closed_does_not_keep_its_process_alive(tmp_path):
    # The writer thread waits on its queue forever: it must not hold the interpreter at exit.
    # Hang guards, not speed bounds: the child's own alarm ends it (SIGALRM) even when this test
    # is killed first (a mutation run's timeout), and the parent's timeout backs it up.
    code = ("import signal, sys; signal.alarm(50); "
            "from kvserve.engine.kv_offload.disk_tier import DiskTier; "
            f"t = DiskTier(sys.argv[1], 4 * {FILE}, {PAYLOAD}, 'layout'); "
            "assert t._writer.is_alive(); print('exiting')")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a process with an open disk tier did not exit")
    assert done.returncode == 0 and done.stdout == "exiting\n", \
        f"a process with an open disk tier did not exit by itself: {done.returncode} {done.stderr}"


def test_a_lock_on_descriptor_0_is_held_and_released(tmp_path):
    # A process started with stdin closed (a daemon, some container runtimes) gets descriptor 0
    # for the lock file: the tier is open, refuses a second claim and releases it on close, as on
    # any other descriptor. In a child, whose stdin can be closed without harm; alarm: hang guard.
    code = ("import os, signal, sys; signal.alarm(50); "
            "from kvserve.engine.errors import ConfigError; "
            "from kvserve.engine.kv_offload.disk_tier import DiskTier; "
            f"make = lambda: DiskTier(sys.argv[1], 4 * {FILE}, {PAYLOAD}, 'layout'); "
            "os.close(0); t = make(); assert t._lock_fd == 0, t._lock_fd; assert t.is_open\n"
            "try:\n    make()\n    sys.exit('a second tier claimed the locked directory')\n"
            "except ConfigError:\n    pass\n"
            "t.close(); assert not t.is_open, 'still open after close'; "
            "make().close(); print('released')")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "released\n", (done.returncode, done.stderr)
