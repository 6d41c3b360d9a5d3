"""`_resumable`, the prefix a KV-cache group can resume after, against its definition on every
pattern of present and missing blocks up to 7 long (a mutation survivor, see docs/mutation.md):
full attention needs every block before the boundary, a sliding group the last `need` of them
(all of them when fewer), a group that needs none resumes anywhere."""

from __future__ import annotations

import itertools

from kvserve.engine.core.kv_cache_manager import _resumable


def by_definition(found: list, k: int, need: int | None) -> int:
    for kk in range(k, -1, -1):
        lo = 0 if need is None else max(0, kk - need)
        if all(found[i] is not None for i in range(lo, kk)):
            return kk
    raise AssertionError("k' = 0 always qualifies")


def test_resumable_matches_its_definition_on_every_small_pattern():
    for n in range(8):
        for present in itertools.product((True, False), repeat=n):
            found = ["block" if p else None for p in present]
            for k in range(n + 1):
                for need in (None, 0, 1, 2, 3, 5):
                    assert _resumable(found, k, need) == by_definition(found, k, need), \
                        (present, k, need)
