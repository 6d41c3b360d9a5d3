"""The prefix index's Lua scripts: every read and write of the index is one of these, so the
inverted index (`h:<hash>` -> holders) and each replica's own block sets stay in step.

Why an inverted index: the first layout kept only the replicas' sets and the lookup walked every
live replica (one SMISMEMBER of the whole chain each), so Redis's one thread spent replicas x
blocks per routing decision (4.7-9.0 ms at 256 replicas, docs/perf.md). Walking the chain through
`h:<hash>` costs what the chain's holders hold instead: the first block's holders, then one
SMISMEMBER of the replicas still matching per further block, stopping when none is left; while a
block's holder set equals the previous block's (a prefix every replica holds) one SINTERCARD of
the two sets stands for the per-holder tests. Replicas holding nothing cost nothing. Holders are
small integers (2*slot, +1 for the host tier) so each `h:*` set is a compact intset.

Conventions: KEYS[1] is the service's `replicas` key (a declared key routes the script to the
Cluster node owning the service's hash tag; the others are derived from the prefix and share the
slot); ARGV[1] is the key prefix. A chain is ONE string of 32-hex-digit hashes (one argument, not
one per block: cheaper to encode and send). A key of the wrong type (a bug, an operator's typo, a
hostile writer) counts as holding nothing when read (redis.pcall) and is replaced when written.
The key layout is in keys.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.replica_info import INFO_FIELDS

HASH_HEX_LEN = 32  # engine.block_hash: blake2b-128 as hex
# Hashes per write call, and entries a clear or a sweep removes per call: each call holds Redis's
# one thread for ~2 ms at most (5,000 took 8.6-11 ms on Zen 4), whatever a replica's cache size, so
# lookups never queue long behind a snapshot or a dead replica's cleanup.
WRITE_CHUNK = 1000
SWEEP_BUDGET = 1000

_SPLIT = """
local prefix = ARGV[1]
local function split(blob)
  local out = {}
  for i = 1, math.floor(#blob / 32) do out[i] = string.sub(blob, (i - 1) * 32 + 1, i * 32) end
  return out
end
local function own_set(id, medium)  -- the replica's own set of one tier, a set or nothing
  local key = prefix .. (medium == 'host' and 'blocks_host:' or 'blocks:') .. id
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'set' and t ~= 'none' then redis.call('DEL', key) end
  return key
end
local function holder_code(slot, medium) return slot * 2 + (medium == 'host' and 1 or 0) end
"""

# ARGV[2]: replica id; then triples (op, medium, chain): op 'add' | 'remove', medium 'device' |
# 'host'. Allocates the replica's slot on its first write. Returns the slot.
UPDATE_SCRIPT = _SPLIT + """
local id = ARGV[2]
local slot = redis.call('HGET', prefix .. 'slots', id)
if not slot then
  slot = redis.call('INCR', prefix .. 'next_slot')
  redis.call('HSET', prefix .. 'slots', id, slot)
  redis.call('HSET', prefix .. 'slot_ids', slot, id)
end
slot = tonumber(slot)
for g = 3, #ARGV - 2, 3 do
  local op, medium = ARGV[g], ARGV[g + 1]
  local own, code = own_set(id, medium), holder_code(slot, medium)
  for _, h in ipairs(split(ARGV[g + 2])) do
    local key = prefix .. 'h:' .. h
    if op == 'add' then
      redis.call('SADD', own, h)
      local r = redis.pcall('SADD', key, code)
      if type(r) == 'table' and r.err then redis.call('DEL', key); redis.call('SADD', key, code) end
    elseif redis.call('SREM', own, h) == 1 then
      redis.pcall('SREM', key, code)
    end
  end
end
return slot
"""

# Takes up to `budget` entries of one replica's tier out of the index (ARGV[2] id, ARGV[3] medium,
# ARGV[4] budget). Returns how many remain: the caller repeats until 0.
_TAKE_OUT = """
local function take_out(id, medium, budget)
  local own = own_set(id, medium)
  if budget <= 0 then return redis.call('SCARD', own) end
  local slot = redis.call('HGET', prefix .. 'slots', id)
  local popped = redis.call('SPOP', own, budget)
  if slot then
    local code = holder_code(tonumber(slot), medium)
    for _, h in ipairs(popped) do redis.pcall('SREM', prefix .. 'h:' .. h, code) end
  end
  return redis.call('SCARD', own), #popped
end
"""
CLEAR_SCRIPT = _SPLIT + _TAKE_OUT + """
return take_out(ARGV[2], ARGV[3], tonumber(ARGV[4]))
"""

# walk(chain) -> matched, on_host: per slot, the LEADING blocks of the chain it holds in either
# tier, and how many of those only its host tier holds (a block in both counts as a device block).
_WALK = """
local function walk(hashes)
  local matched, on_host, flag = {}, {}, {}  -- flag[s]: 1 when s holds the last block on host only
  if #hashes == 0 then return matched, on_host end
  local prev = prefix .. 'h:' .. hashes[1]
  local first = redis.pcall('SMEMBERS', prev)
  if first.err then return matched, on_host end
  local cur = {}
  for _, v in ipairs(first) do
    v = tonumber(v)
    if v and v >= 2 and v == math.floor(v) then  -- slots start at 1: anything else is junk
      local s, host = math.floor(v / 2), v % 2
      if matched[s] == nil then cur[#cur + 1] = s; matched[s] = 1; flag[s] = host
      elseif host == 0 then flag[s] = 0 end
    end
  end
  for _, s in ipairs(cur) do on_host[s] = flag[s] end
  local codes, stale = {}, true  -- cur's holder codes as strings, rebuilt when cur shrinks
  for i = 2, #hashes do
    if #cur == 0 then break end
    local key = prefix .. 'h:' .. hashes[i]
    -- Many holders: when block i's holder set equals block i-1's (a prefix every replica holds),
    -- every holder goes on with the same tiers, at the cost of a set intersection in C instead of
    -- one membership test per holder.
    local same = false
    if #cur > 8 then
      local n_prev, n = redis.pcall('SCARD', prev), redis.pcall('SCARD', key)
      if type(n) == 'number' and n == n_prev then
        same = redis.pcall('SINTERCARD', 2, prev, key) == n
      end
    end
    if same then
      for _, s in ipairs(cur) do matched[s] = i; on_host[s] = on_host[s] + flag[s] end
    else
      if stale then
        codes = {}
        for j, s in ipairs(cur) do
          codes[2 * j - 1] = tostring(s * 2); codes[2 * j] = tostring(s * 2 + 1)
        end
        stale = false
      end
      local nxt = {}
      for c = 1, #cur, 1000 do  -- unpack() is bounded by the C stack: 2000 codes a call
        local last = math.min(c + 999, #cur)
        local flags = redis.pcall('SMISMEMBER', key, unpack(codes, 2 * c - 1, 2 * last))
        if flags.err then flags = {} end
        for j = c, last do
          local s, k = cur[j], (j - c) * 2 + 1
          if flags[k] == 1 or flags[k + 1] == 1 then
            nxt[#nxt + 1] = s; matched[s] = i
            flag[s] = flags[k] == 1 and 0 or 1
            on_host[s] = on_host[s] + flag[s]
          end
        end
      end
      if #nxt < #cur then stale = true end
      cur = nxt
    end
    prev = key
  end
  return matched, on_host
end
"""

# The router's once-a-second scan, with a chain (tests, tools) or without. ARGV[2]: chain;
# ARGV[3]: sweep budget. Per live replica: id, leading matched blocks, host-only ones among them,
# then its heartbeat fields in INFO_FIELDS order (a heartbeat key of another type yields empty
# fields, which the parser rejects). Replicas whose heartbeat expired move to `dead`; then up to
# `budget` entries of dead replicas are taken out of the index, and a dead replica whose entries
# are all gone loses its slot. A replica back from the dead (its heartbeat exists again) leaves
# `dead` untouched: its own snapshot rebuilds its entries.
LOOKUP_SCRIPT = _SPLIT + _TAKE_OUT + _WALK + """
local matched, on_host = walk(split(ARGV[2] or ''))
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', prefix .. 'replicas')) do
  local key = prefix .. 'replica:' .. id
  if redis.call('EXISTS', key) == 0 then
    redis.call('SREM', prefix .. 'replicas', id)
    redis.call('SADD', prefix .. 'dead', id)
  else
    local info = redis.pcall('HMGET', key, %s)
    if info.err then info = {} end
    local slot = tonumber(redis.call('HGET', prefix .. 'slots', id) or '')
    out[#out + 1] = id
    out[#out + 1] = slot and matched[slot] or 0
    out[#out + 1] = slot and on_host[slot] or 0
    for i = 1, %d do out[#out + 1] = info[i] or '' end
  end
end
local budget = tonumber(ARGV[3]) or 0
for _, id in ipairs(redis.call('SMEMBERS', prefix .. 'dead')) do
  if budget <= 0 then break end
  if redis.call('EXISTS', prefix .. 'replica:' .. id) == 1 then
    redis.call('SREM', prefix .. 'dead', id)
  else
    local left = 0
    for _, medium in ipairs({'device', 'host'}) do
      local l, taken = take_out(id, medium, budget)
      budget = budget - (taken or 0)
      left = left + l
    end
    if left == 0 then
      redis.call('SREM', prefix .. 'dead', id)
      local slot = redis.call('HGET', prefix .. 'slots', id)
      if slot then
        redis.call('HDEL', prefix .. 'slots', id)
        redis.call('HDEL', prefix .. 'slot_ids', slot)
      end
    end
  end
end
return out
""" % (", ".join(f"'{f}'" for f in INFO_FIELDS), len(INFO_FIELDS))

# The per-request hot path. ARGV[2]: chain. id, matched, host-only, id, ... for the live replicas
# holding at least the chain's first block (live: in `replicas`, which the routers' scans keep);
# the router knows the others from its scan. Two calls resolve every holder's id and liveness.
MATCH_SCRIPT = _SPLIT + _WALK + """
local matched, on_host = walk(split(ARGV[2] or ''))
local slots = {}
for slot in pairs(matched) do slots[#slots + 1] = slot end
local out = {}
for c = 1, #slots, 4000 do  -- unpack() is bounded by the C stack
  local last = math.min(c + 3999, #slots)
  local ids = redis.call('HMGET', prefix .. 'slot_ids', unpack(slots, c, last))
  local named, where = {}, {}
  for j = c, last do
    local id = ids[j - c + 1]
    if id then named[#named + 1] = id; where[#named] = slots[j] end
  end
  if #named > 0 then
    local live = redis.call('SMISMEMBER', prefix .. 'replicas', unpack(named))
    for j, id in ipairs(named) do
      if live[j] == 1 then
        out[#out + 1] = id
        out[#out + 1] = matched[where[j]]
        out[#out + 1] = on_host[where[j]]
      end
    end
  end
end
return out
"""


def chain_blob(hashes: Sequence[str]) -> str:
    """The chain as one argument; raises ValueError unless every hash is 32 hex digits."""
    blob = "".join(hashes)
    if len(blob) != HASH_HEX_LEN * len(hashes):
        raise ValueError("block hashes must be 32-hex-digit strings from engine.block_hash")
    return blob


def write_calls(keys: IndexKeys, replica_id: str,
                ops: Sequence[tuple[str, str, Sequence[str]]]) -> list[list[str]]:
    """The UPDATE_SCRIPT argument lists for `ops` [(op, medium, hashes)], in order, each call
    carrying at most WRITE_CHUNK hashes."""
    calls: list[list[str]] = []
    args: list[str] = []
    size = 0
    for op, medium, hashes in ops:
        for i in range(0, len(hashes), WRITE_CHUNK):
            part = hashes[i : i + WRITE_CHUNK]
            if args and size + len(part) > WRITE_CHUNK:
                calls.append([keys.prefix, replica_id, *args])
                args, size = [], 0
            args += [op, medium, chain_blob(part)]
            size += len(part)
    if args:
        calls.append([keys.prefix, replica_id, *args])
    return calls


def add_blocks(client: Any, keys: IndexKeys, replica_id: str, hashes: Sequence[str],
               medium: str = "device") -> None:
    """Index `hashes` as held by `replica_id` with a synchronous client (tests, benchmarks and
    tools; replicas publish through publisher.py)."""
    for args in write_calls(keys, replica_id, [("add", medium, list(hashes))]):
        client.eval(UPDATE_SCRIPT, 1, keys.replicas, *args)
