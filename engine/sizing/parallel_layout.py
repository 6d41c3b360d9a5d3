"""A replica's parallel layout for a concurrency target: tensor parallel (TP) inside a node,
pipeline parallel (PP) across nodes, and the number of replicas that hold N concurrent requests
of the full context length at the fewest GPUs. Pure arithmetic, torch-free: the caller says how
many full-length requests one replica of a layout holds (the memory budget, per rank).

Rules (vLLM's and LeaderWorkerSet's): TP is a power of two that divides the heads and stays
within one node (TP across nodes all-reduces twice per layer over the node link, so it is
listed and refused); pipeline stages come only once TP fills what a node allows (a stage adds
capacity, never per-token speed, so a smaller TP with more stages is never the better replica);
a replica of more GPUs than a node spans ceil(TP x PP / gpus_per_node) pods, each holding whole
pipeline stages (PP divisible by the pod count); among the layouts
that hold the target, the fewest GPUs wins, then the fewest nodes per replica, then the
shortest pipeline, then the smallest TP (more, smaller replicas at equal cost).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_TARGET_CONCURRENCY = 32  # full-length requests planned for when no target is given
MAX_PIPELINE_STAGES = 16  # the longest pipeline the planner considers

TOO_LITTLE_KV = "too little KV"
CROSS_NODE_TP = "cross-node TP"
MORE_GPUS = "more GPUs"
TIE_BREAK = "tie-break"  # as many GPUs, but more nodes, stages or TP ranks than the chosen
UNEVEN_PODS = "uneven pods"
CHOSEN = "chosen"


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    gpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def nodes(self) -> int:
        """Pods (one per node) of one replica."""
        return -(-self.gpus // self.gpus_per_node)

    @property
    def gpus_per_pod(self) -> int:
        return self.gpus // self.nodes


@dataclass(frozen=True)
class Option:
    """One layout, what a replica of it holds, and the verdict on it."""

    layout: Layout
    concurrency: int  # full-length requests one replica holds (capped at max_num_seqs)
    replicas: int  # replicas for the target (0: a replica holds no full-length request)
    verdict: str  # CHOSEN or why it was rejected
    detail: str = ""

    @property
    def total_gpus(self) -> int:
        return self.layout.gpus * self.replicas

    def as_status(self) -> dict:
        return {"tensorParallelSize": self.layout.tp, "pipelineParallelSize": self.layout.pp,
                "nodesPerReplica": self.layout.nodes, "gpusPerReplica": self.layout.gpus,
                "maxConcurrency": self.concurrency, "replicas": self.replicas,
                "totalGpus": self.total_gpus, "verdict": self.verdict,
                **({"detail": self.detail} if self.detail else {})}


@dataclass(frozen=True)
class Choice:
    chosen: Option | None  # None: no layout holds one full-length request
    rejected: tuple[Option, ...]  # the alternatives worth showing, with why


def candidate_layouts(tp_sizes: Iterable[int], layers: int, gpus_per_node: int,
                      max_gpus: int) -> tuple[list[Layout], list[Option]]:
    """(layouts to size, layouts refused on their shape alone)."""
    ok, refused = [], []
    tp_sizes = list(tp_sizes)
    node_tp = max((tp for tp in tp_sizes if tp <= gpus_per_node), default=0)
    for tp in tp_sizes:
        if tp > gpus_per_node:
            refused.append(Option(Layout(tp, 1, gpus_per_node), 0, 0, CROSS_NODE_TP,
                                  f"TP {tp} > {gpus_per_node} GPUs per node: the all-reduce of "
                                  "every layer would cross the node link"))
            continue
        stages = min(layers, MAX_PIPELINE_STAGES) if tp == node_tp else 1
        for pp in range(1, stages + 1):
            layout = Layout(tp, pp, gpus_per_node)
            if layout.gpus > max_gpus:
                break
            if layout.nodes > 1 and pp % layout.nodes:
                continue  # a pod would hold part of a stage: never a candidate
            ok.append(layout)
    return ok, refused


def _rank(option: Option) -> tuple[int, int, int, int]:
    lay = option.layout
    return (option.total_gpus, lay.nodes, lay.pp, lay.tp)


def choose(layouts: list[Layout], concurrency: Callable[[Layout], int], target: int,
           max_num_seqs: int, refused: Iterable[Option] = ()) -> Choice:
    """The layout and replica count that hold `target` full-length requests at the fewest
    GPUs; per TP the best rejected option and the longest pipeline that held too little KV."""
    fits, short = [], {}
    for layout in layouts:
        held = min(concurrency(layout), max_num_seqs)
        if held < 1:
            short[layout.tp] = Option(layout, 0, 0, TOO_LITTLE_KV,
                                      "no room for one full-length request" + (
                                          f" on {layout.pp} stages or fewer"
                                          if layout.pp > 1 else ""))
            continue
        fits.append(Option(layout, held, -(-target // held), MORE_GPUS))
    if not fits:
        return Choice(None, (*refused, *short.values()))
    fits.sort(key=_rank)
    best = fits[0]
    chosen = Option(best.layout, best.concurrency, best.replicas, CHOSEN)
    shown, seen_tp = [], {best.layout.tp}
    for option in fits[1:]:
        if option.layout.tp not in seen_tp:  # the best of every other TP
            seen_tp.add(option.layout.tp)
            shown.append(_why_not(option, best))
    if best.layout.pp > 1:  # the same TP on a shorter pipeline or one more stage
        shown += [_why_not(o, best) for o in fits[1:] if o.layout.tp == best.layout.tp
                  and abs(o.layout.pp - best.layout.pp) == 1]
    return Choice(chosen, (*shown, *short.values(), *refused))


def _why_not(option: Option, best: Option) -> Option:
    """More GPUs, or as many but more nodes, stages or TP ranks (the tie-break)."""
    if option.total_gpus > best.total_gpus:
        return option
    return Option(option.layout, option.concurrency, option.replicas, TIE_BREAK,
                  "as many GPUs; the chosen layout has fewer nodes, stages or TP ranks")
