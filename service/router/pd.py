"""Prefill/decode disaggregation in the router (`--policy pd`), in vLLM's `kv_transfer_params`
protocol (what llm-d's routing sidecar speaks).

The decode replica is chosen first, prefix-aware, among the replicas whose heartbeat role is
decode or both. The prompt goes to a prefill replica (role prefill or both, not the decode one)
only when the part of it the decode replica does not hold (prompt tokens minus its predicted
match) exceeds `--pd-threshold` tokens and the best prefill replica's queue (running + waiting,
or the routers' in-flight count if larger) is at most `--pd-max-prefill-queue`; otherwise the
decode replica prefills locally. A remote prefill is the request with `max_tokens=1`, not
streamed, and `kv_transfer_params: {"do_remote_decode": true}`; its answer's
`kv_transfer_params` (do_remote_prefill, remote_block_ids, remote_engine_id, remote_host,
remote_port) go into the body sent to the decode replica, whose connector pulls the blocks. A
prefill that fails, times out or answers without parameters costs nothing but its time: the
decode replica gets the request as it came and prefills it itself. A replica that answered a
prefill without parameters (role `both` but no connector) is not asked again for
NOT_A_PRODUCER_S seconds: its prefills would all be computed twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvserve.service.routing_policy import Candidate, PolicyConfig, rank_prefix

logger = logging.getLogger("kvserve.router")

ROLE_PREFILL, ROLE_DECODE = "prefill", "decode"
# Why a request was (or was not) prefilled remotely: kvserve:router_pd_decisions_total{decision}.
REMOTE = "remote"  # prefilled on a prefill replica, its blocks handed to the decode replica
LOCAL_SHORT = "local_short"  # the uncached part is within --pd-threshold
LOCAL_BUSY = "local_busy"  # every prefill replica's queue is above --pd-max-prefill-queue
LOCAL_NO_PREFILLER = "local_no_prefiller"  # no prefill-capable replica besides the decode one
LOCAL_UNKNOWN = "local_unknown_prompt"  # the router could not tokenize the prompt
LOCAL_ADAPTER = "local_adapter"  # a LoRA adapter's request: prefilled where the adapter is
FALLBACK = "fallback"  # the remote prefill failed or gave no parameters: local prefill
DECISIONS = (REMOTE, LOCAL_SHORT, LOCAL_BUSY, LOCAL_NO_PREFILLER, LOCAL_UNKNOWN, LOCAL_ADAPTER,
             FALLBACK)
# Seconds a replica that answered a prefill without kv_transfer_params is left out of the
# prefill pool (a `both` replica without a KV connector, or one whose connector is not a producer).
NOT_A_PRODUCER_S = 60.0
# The routes a prefill replica is asked through (their bodies take max_tokens).
PATHS = ("/v1/completions", "/v1/chat/completions")
# Fields a prefill request must not carry: a prefill generates one token, whole.
_PREFILL_DROPS = ("stream_options", "min_tokens", "best_of", "use_beam_search")


@dataclass(frozen=True)
class PDConfig:
    """`--pd-threshold`, `--pd-max-prefill-queue`, `--pd-prefill-timeout`."""

    threshold: int = 256  # uncached prompt tokens above which a prefill replica does the prefill
    max_prefill_queue: int = 4  # a prefill replica with a longer queue is not used
    prefill_timeout: float = 60.0  # seconds for a prefill replica's answer before local prefill

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.max_prefill_queue < 0 or not self.prefill_timeout > 0:
            raise ValueError("--pd-threshold and --pd-max-prefill-queue must be >= 0 and "
                             "--pd-prefill-timeout > 0")


@dataclass(frozen=True)
class PDPlan:
    """The pd decision of one request: `decision` (DECISIONS) and, for REMOTE, the prefill
    replicas in the order to try them."""

    decision: str
    uncached_tokens: int
    prefill: tuple[Candidate, ...] = ()

    @property
    def remote(self) -> bool:
        return self.decision == REMOTE


def decode_capable(cands: Sequence[Candidate]) -> list[Candidate]:
    """Replicas that take decode work (decode or both); all of them when none announces it."""
    out = [c for c in cands if c.role != ROLE_PREFILL]
    return out or list(cands)


def prefill_capable(cands: Sequence[Candidate], decode_id: str | None,
                    skip: frozenset[str] | set[str] = frozenset()) -> list[Candidate]:
    """Replicas that may prefill for `decode_id` (prefill or both, not itself, not in `skip`)."""
    return [c for c in cands if c.role != ROLE_DECODE and c.replica_id != decode_id
            and c.replica_id not in skip]


def plan(decode: Candidate | None, cands: Sequence[Candidate], prompt_tokens: int | None,
         block_size: int, pd: PDConfig, policy: PolicyConfig, num_blocks: int = 0,
         tiebreak: int = 0, skip: frozenset[str] | set[str] = frozenset()) -> PDPlan:
    """Remote or local prefill for a request routed to `decode` (None: no replica at all).
    `prompt_tokens` None: the router could not tokenize the prompt (local). `skip`: replicas
    known not to answer with transfer parameters (NOT_A_PRODUCER_S)."""
    if decode is None or prompt_tokens is None:
        return PDPlan(LOCAL_UNKNOWN, 0)
    cached = min(decode.matched_blocks * block_size, prompt_tokens)
    uncached = prompt_tokens - cached
    if uncached <= pd.threshold:
        return PDPlan(LOCAL_SHORT, uncached)
    pool = prefill_capable(cands, decode.replica_id, skip)
    if not pool or decode.role == ROLE_PREFILL:  # a producer-only replica would not pull
        return PDPlan(LOCAL_NO_PREFILLER, uncached)
    short = [c for c in pool if c.load <= pd.max_prefill_queue]
    if not short:
        return PDPlan(LOCAL_BUSY, uncached)
    # Among the short queues, a prefill replica holding more of the prompt prefills less.
    ranked, _ = rank_prefix(short, num_blocks, block_size, policy, tiebreak)
    return PDPlan(REMOTE, uncached, tuple(ranked))


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill replica gets: one token, whole, asked to keep its blocks for a
    remote decode (vLLM's `do_remote_decode`)."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(max_tokens=1, stream=False,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def transfer_params(answer: Any) -> dict[str, Any] | None:
    """The decode request's `kv_transfer_params` from a prefill replica's JSON answer; None
    when it holds none a decode replica could pull from."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill") or \
            not isinstance(params.get("remote_block_ids"), list):
        return None
    return params


async def remote_prefill(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                         headers: dict[str, str], ranking: Sequence[Candidate], pd: PDConfig,
                         acquire: Any, release: Any, mark_down: Any = None,
                         not_a_producer: Any = None) -> tuple[dict[str, Any], str] | None:
    """Prefill on the first replica of `ranking` that answers (one try each, within
    `pd.prefill_timeout` in all): (kv_transfer_params, its replica id), or None (local). A
    replica that refuses the connection is `mark_down`'d, as the proxy does; one that answers
    without transfer parameters is passed to `not_a_producer`."""
    payload = prefill_body(body)
    for cand in ranking[:2]:  # a second replica only when the first fails fast
        acquire(cand.replica_id)
        try:
            resp = await http.post(cand.url.rstrip("/") + path, json=payload, headers=headers,
                                   timeout=pd.prefill_timeout)
            answer = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("pd: prefill on %s failed (%s: %s)", cand.replica_id,
                           type(exc).__name__, exc)
            if mark_down is not None and isinstance(exc, (httpx.ConnectError,
                                                          httpx.ConnectTimeout)):
                mark_down(cand.replica_id)
            if isinstance(exc, httpx.TimeoutException):
                return None  # the time is spent: the decode replica prefills now
            continue
        finally:
            release(cand.replica_id)
        params = transfer_params(answer)
        if params is not None:
            return params, cand.replica_id
        logger.info("pd: prefill replica %s answered %d without kv_transfer_params; the "
                    "decode replica prefills locally", cand.replica_id, resp.status_code)
        if not_a_producer is not None and resp.status_code == 200:
            not_a_producer(cand.replica_id)
        return None
    return None
