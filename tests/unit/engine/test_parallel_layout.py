"""The layout chooser on synthetic budgets: fewest GPUs for the target, then fewer nodes,
shorter pipelines, smaller TP; TP never across nodes; stages only once TP fills a node."""

from __future__ import annotations

from kvserve.engine.sizing.parallel_layout import (
    CHOSEN, CROSS_NODE_TP, TIE_BREAK, TOO_LITTLE_KV, Layout, candidate_layouts, choose,
)


def per_gpu(requests_per_gpu: int, weight_gpus: int):
    """A model whose weights need `weight_gpus` GPUs; each GPU past them holds KV for
    `requests_per_gpu` full-length requests."""
    return lambda lay: max(lay.gpus - weight_gpus, 0) * requests_per_gpu


def test_tp_stays_in_a_node_and_stages_come_after_a_full_node() -> None:
    layouts, refused = candidate_layouts([1, 2, 4, 8, 16], layers=32, gpus_per_node=8,
                                         max_gpus=64)
    assert [r.layout.tp for r in refused] == [16] and refused[0].verdict == CROSS_NODE_TP
    assert {lay.pp for lay in layouts if lay.tp < 8} == {1}
    assert [lay.pp for lay in layouts if lay.tp == 8] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert Layout(8, 3, 8).nodes == 3 and Layout(8, 3, 8).gpus_per_pod == 8


def test_a_pod_holds_whole_stages() -> None:
    # TP 4 is the most the heads allow: 3 stages of 4 = 12 GPUs would split a stage over pods.
    layouts, _ = candidate_layouts([1, 2, 4], layers=24, gpus_per_node=8, max_gpus=24)
    staged = [(lay.pp, lay.nodes) for lay in layouts if lay.tp == 4]
    assert (3, 2) not in staged and (4, 2) in staged and (2, 1) in staged
    assert (6, 3) in staged


def test_fewest_gpus_wins_then_fewer_nodes_stages_and_tp() -> None:
    layouts, refused = candidate_layouts([1, 2, 4, 8], layers=80, gpus_per_node=8, max_gpus=32)
    choice = choose(layouts, per_gpu(requests_per_gpu=10, weight_gpus=1), target=32,
                    max_num_seqs=256, refused=refused)
    # 1 GPU holds nothing; TP 2: 10 each -> 4 replicas = 8 GPUs; TP 4: 30 -> 2 x 4 = 8;
    # TP 8: 70 -> 1 x 8 = 8. Equal GPUs, one node each, no stages: the smallest TP.
    assert choice.chosen is not None and choice.chosen.verdict == CHOSEN
    assert (choice.chosen.layout.tp, choice.chosen.replicas, choice.chosen.total_gpus) == (2, 4, 8)
    verdicts = {(o.layout.tp, o.layout.pp): o.verdict for o in choice.rejected}
    assert verdicts[(1, 1)] == TOO_LITTLE_KV and verdicts[(4, 1)] == TIE_BREAK
    assert "as many GPUs" in next(o.detail for o in choice.rejected if o.layout.tp == 4)


def test_a_model_past_one_node_gets_pipeline_stages() -> None:
    layouts, refused = candidate_layouts([1, 2, 4, 8, 16], layers=126, gpus_per_node=8,
                                         max_gpus=128)
    choice = choose(layouts, per_gpu(requests_per_gpu=6, weight_gpus=12), target=32,
                    max_num_seqs=256, refused=refused)
    assert choice.chosen is not None
    lay = choice.chosen.layout
    # 16 GPUs (TP 8 x PP 2) hold 24, so 2 replicas = 32 GPUs; 24 GPUs (PP 3) hold 72: 1 x 24.
    assert (lay.tp, lay.pp, lay.nodes, choice.chosen.replicas) == (8, 3, 3, 1)


def test_the_engine_cap_and_no_fit() -> None:
    layouts, _ = candidate_layouts([1], layers=4, gpus_per_node=1, max_gpus=1)
    capped = choose(layouts, lambda lay: 1000, target=300, max_num_seqs=256)
    assert capped.chosen is not None
    assert (capped.chosen.concurrency, capped.chosen.replicas) == (256, 2)
    none = choose(layouts, lambda lay: 0, target=1, max_num_seqs=256)
    assert none.chosen is None and none.rejected[0].verdict == TOO_LITTLE_KV
