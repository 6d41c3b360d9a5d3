"""ModelRunner: owns the model and the KV-cache tensors; turns a SchedulerOutput into one
flattened forward pass (prefill and decode tokens together, no padding) and samples the rows
the engine asks for. It makes no scheduling decisions.

With tensor parallelism the driver's runner builds each step's inputs once (a StepInput of CPU
tensors), hands them to the worker processes, and every rank runs the same `run_step` against its
own shard and KV cache; only the driver samples. Decode CUDA graphs are captured on every rank
together, kept only if every rank's capture succeeded, and the driver names in the StepInput the
graph size every rank replays.

With pipeline stages (a StageLink), each rank runs its stage's layers: a stage after the first
starts from the (hidden states, residual) the previous stage sends, a stage before the last
sends its own on; the last stage computes the sampled rows' logits and prompt logprobs and
samples with the SamplingMetadata the step carries (unless the driver holds a logits hook: then
it returns the logits), and the driver (stage 0) receives that from the last stage's first
rank."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvserve.engine.core.kv_cache_groups import KVCacheGroups
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.scheduler import SchedulerOutput
from kvserve.engine.kv_offload.host_blocks import CopyTiming, HostBlocks
from kvserve.engine.kv_offload.swap_pool import SwapPool
from kvserve.engine.sample.prompt_logprobs import PromptLogprobsPlan, PromptLogprobsResult
from kvserve.engine.sample.prompt_logprobs import compute as compute_prompt_logprobs
from kvserve.engine.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from kvserve.engine.worker.cuda_graph import (Capture, DecodeGraphs, cuda_capture,
                                              graphs_log_line, pad_to_uniform)
from kvserve.engine.worker.step_input import BlockMoves, StepInput
from kvserve.kernels.backend import resolve_backend
from kvserve.kernels.fp8 import compute_kv_scale
from kvserve.kernels.metadata import AttentionMetadata
from kvserve.kernels.plan import plan_attention

if TYPE_CHECKING:
    from kvserve.engine.kv_offload.disk_tier import DiskTier
    from kvserve.engine.worker.pipeline import StageLink

logger = logging.getLogger("kvserve.engine")


class Peers(Protocol):
    """The other tensor-parallel ranks as the driver's runner sees them (workers.WorkerGroup,
    which imports this module: the runner names only what it calls)."""

    def broadcast(self, cmd: str, arg: object) -> None: ...

    def wait_for(self, expected: str) -> list[object]: ...

    def failed(self, exc: BaseException) -> Exception: ...

    def receive_output(self) -> Any: ...


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, num_cpu_blocks: int = 0, attention_backend: str = "auto",
                 k_scale: float = 1.0, v_scale: float = 1.0,
                 workers: "Peers | None" = None, num_host_blocks: int = 0,
                 disk: "DiskTier | None" = None, kv_groups: KVCacheGroups | None = None,
                 kv_view: torch.Tensor | None = None,
                 link: "StageLink | None" = None) -> None:
        self.model = model
        self.link = link  # this rank's neighbouring pipeline stages (None: one stage)
        self.workers = workers  # the other ranks (tensor parallel, driver only)
        self.device = device
        self.block_size = block_size
        # Resolved once here: on the CPU, "auto" builds the fused decode kernel now (once per
        # machine), not in the middle of the first step.
        self.backend = resolve_backend(attention_backend, device)
        self.k_scale, self.v_scale = k_scale, v_scale
        # A block is a page of `page_layers` layers; layer i uses page position slots[i][1] of
        # the pages its group's tables name (kv_cache_groups.py). One group: every layer.
        self.kv_groups = kv_groups or KVCacheGroups.single(num_layers)
        pages = self.kv_groups.page_layers
        shape = (2, pages, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: padded attention reads of unused slots must never see NaN garbage.
        # `kv_view`: this model's view of a KV region shared by several models (kv_region.py).
        if kv_view is not None and (tuple(kv_view.shape) != shape or kv_view.dtype != kv_dtype):
            raise ValueError(f"kv_view is {tuple(kv_view.shape)} {kv_view.dtype}, the model "
                             f"needs {shape} {kv_dtype}")
        self.kv = kv_view if kv_view is not None else torch.zeros(shape, dtype=kv_dtype,
                                                                  device=device)
        self.kv_caches = [(self.kv[0, j], self.kv[1, j]) for _, j in self.kv_groups.slots]
        # The swap pool: allocated chunk by chunk as blocks are swapped out (swap_pool.py).
        self.swap: SwapPool | None = None
        if num_cpu_blocks:
            self.swap = SwapPool(num_cpu_blocks, (2, pages, block_size, num_kv_heads, head_dim),
                                 kv_dtype, pin_memory=device.type == "cuda")
        self.host = HostBlocks(self.kv, num_host_blocks) if num_host_blocks else None
        self.disk = disk  # where spilled host blocks go (one rank: the config refuses more)
        self.timings: deque[CopyTiming] = deque(maxlen=4096)
        self.sampler = Sampler()
        self.logits_hook: Any = None  # logits -> logits, set per step by the engine
        self.graphs: DecodeGraphs | None = None  # captured decode forwards (CUDA, not eager)
        self.lora = getattr(model, "lora_model", None)  # kvserve.lora.model.LoRAModel
        self.kv_connector: Any = None  # a KV connector's worker side (engine/kv_transfer/)
        self.keep_hidden = False  # keep the last forward's hidden states (EAGLE proposers)
        self.last_hidden: torch.Tensor | None = None

    def attach_kv_connector(self, connector: Any) -> None:
        """A KV connector's worker side on this runner's cache: its loads land layer by layer
        inside the forward where the model calls a per-layer hook (`layer_hook`, set here to
        the connector's wait_for_layer_load), else all before the forward."""
        self.kv_connector = connector
        decoder = getattr(self.model, "model", None)
        if self.link is None and hasattr(decoder, "layer_hook"):
            decoder.layer_hook = lambda j: connector.wait_for_layer_load(f"layers.{j}")
            connector.layerwise = True

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block on this rank (every layer, K and V)."""
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def take_copy_timings(self) -> list[CopyTiming]:
        """The batched copies since the last call (the newest 4,096 kept)."""
        if self.host is not None:
            self.timings.extend(self.host.take_timings())
        out = list(self.timings)
        self.timings.clear()
        return out

    def move_blocks(self, sched: SchedulerOutput) -> None:
        """Swap-out, swap-in and copy-on-write copies, before this step writes any slot (on every
        rank: a step with nothing to compute may still move blocks)."""
        moves = _moves(sched)
        if moves and self.workers is not None:
            self.workers.broadcast("move", moves)
        self.apply_moves(moves)

    def apply_moves(self, m: BlockMoves) -> None:
        for medium, index, block_hash in m.spill:  # a copy of each block for the disk writer
            data = self.host.read_block(index, from_device=medium == "device")  # type: ignore
            self.disk.put(block_hash, bytearray(data.numpy()))  # type: ignore[union-attr]
        if m.offload:
            self.host.offload(m.offload)  # type: ignore[union-attr]
        if m.swap_out:
            t0 = self._clock()
            src, dst = zip(*m.swap_out)
            self.swap.write(list(dst), self.kv[:, :, list(src)])  # type: ignore[union-attr]
            self._timed("swap_out", len(src), t0)
        if m.restore:
            self.host.restore(m.restore)  # type: ignore[union-attr]
        if m.load:
            self.host.load(m.load)  # type: ignore[union-attr]
        if m.swap_in:
            t0 = self._clock()
            src, dst = zip(*m.swap_in)
            self.kv[:, :, list(dst)] = self.swap.read(list(src), self.device)  # type: ignore[union-attr]
            self._timed("swap_in", len(src), t0)
        if m.copy:
            src, dst = zip(*m.copy)
            self.kv[:, :, list(dst)] = self.kv[:, :, list(src)]
        if m.kv_meta and self.kv_connector is not None:
            self.kv_connector.bind_connector_metadata(m.kv_meta)
            self.kv_connector.start_load_kv()
            self.kv_connector.clear_connector_metadata()

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def _timed(self, kind: str, num_blocks: int, t0: float) -> None:
        self.timings.append(CopyTiming(kind, num_blocks * self.bytes_per_block,
                                       self._clock() - t0))

    def load_lora(self, slot: int, weights: Any) -> None:
        """Copy an adapter (LoRAWeights, None: empty) into a slot, on every rank."""
        if self.workers is not None:
            self.workers.broadcast("lora", (slot, weights))
        self.apply_lora(slot, weights)

    @torch.inference_mode()
    def apply_lora(self, slot: int, weights: Any) -> None:
        self.lora.set_slot(slot, weights)  # type: ignore[union-attr]

    def build_step(self, sched: SchedulerOutput, kv: KVCacheManager,
                   sample_rows: list[int], lora_slots: list[int] | None = None) -> StepInput:
        """Token ids, positions, slot mapping and block tables of the flattened batch
        (`lora_slots`: each seq's adapter slot, -1 for none)."""
        input_ids: list[int] = []
        starts: list[int] = []
        num_groups = len(self.kv_groups.groups)
        tables: list[list[int]] = []  # group-major: every seq of group 0, then group 1, ...
        drafts = sched.spec_token_ids or [[] for _ in sched.seqs]
        for seq, n, d in zip(sched.seqs, sched.num_tokens, drafts):
            s = seq.num_computed_tokens
            input_ids += seq.token_range(s, s + n - len(d))
            input_ids += d  # speculative decoding: drafts scored after the last token
            starts.append(s)
        for g in range(num_groups):
            tables += [kv.block_ids(seq, g) for seq in sched.seqs]
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                          dtype=torch.int32).view(num_groups, len(sched.seqs), width)
        q_lens = torch.tensor(sched.num_tokens, dtype=torch.int64)
        start_t = torch.tensor(starts, dtype=torch.int64)
        qsl = torch.zeros(len(sched.seqs) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(sched.seqs)), q_lens)
        positions = torch.arange(int(qsl[-1])) - qsl[:-1].long()[seq_idx] + start_t[seq_idx]
        slots = (bt[:, seq_idx, positions // self.block_size].long() * self.block_size
                 + positions % self.block_size)
        seq_lens = (start_t + q_lens).to(torch.int32)
        step = StepInput(torch.tensor(input_ids, dtype=torch.int64), positions, slots, bt,
                         seq_lens, qsl, int(q_lens.max()), int(seq_lens.max()), sample_rows,
                         _moves(sched))
        if lora_slots is not None and max(lora_slots) >= 0:
            step.lora_slots = torch.tensor(lora_slots, dtype=torch.int64)[seq_idx]
        step.embeds = self._prompt_embeds(sched)
        return step

    def _prompt_embeds(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's rows whose input is a prompt embedding and those embeddings (this chunk's
        slice of each prompt; a recompute after preemption feeds them again), in the model's
        dtype; None when no scheduled token has one."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        offset = 0
        dtype = getattr(self.model, "dtype", torch.float32)
        for seq, n in zip(sched.seqs, sched.num_tokens):
            s, p = seq.num_computed_tokens, seq.num_prompt_tokens
            if seq.prompt_embeds is not None and s < p:
                end = min(s + n, p)
                rows.append(torch.arange(offset, offset + end - s))
                values.append(seq.prompt_embeds[s:end].to(dtype))
            offset += n
        if not rows:
            return None
        return torch.cat(rows), torch.cat(values)

    def prepare(self, sched: SchedulerOutput, kv: KVCacheManager) -> tuple[torch.Tensor,
                                                                           torch.Tensor,
                                                                           AttentionMetadata]:
        """Token ids, positions and attention metadata of the flattened batch, on the device."""
        return self.to_device(self.build_step(sched, kv, []))

    def to_device(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor,
                                                  AttentionMetadata]:
        # Planned and range-checked on the host tensors, then copied: nothing here (nor in the
        # kernels, which trust the plan) reads a value back from the device.
        seq_lens, qsl = self._dev(step.seq_lens), self._dev(step.query_start_loc)
        max_q, max_s = step.max_query_len, step.max_seq_len
        groups = []
        num_slots = self.kv.shape[2] * self.kv.shape[3]
        for host_bt, host_slots in zip(step.block_tables, step.slot_mapping):
            if host_slots.numel() and int(host_slots.max()) >= num_slots:
                raise ValueError(f"slot {int(host_slots.max())} is past the pool's {num_slots}")
            host_plan = plan_attention(host_bt, step.seq_lens, step.query_start_loc,
                                       self.block_size, max_q, max_s)
            bt, slots = self._dev(host_bt), self._dev(host_slots)
            plan = replace(host_plan, block_tables=bt, seq_lens_t=seq_lens, query_start_loc=qsl)
            groups.append(AttentionMetadata(
                slot_mapping=slots, block_tables=bt, seq_lens=seq_lens, query_start_loc=qsl,
                max_query_len=max_q, max_seq_len=max_s, k_scale=self.k_scale,
                v_scale=self.v_scale, backend=self.backend, plan=plan))
        meta = groups[0]
        if len(groups) > 1:
            meta = replace(meta, groups=tuple(groups), layer_groups=self.kv_groups.layer_groups)
        return self._dev(step.input_ids), self._dev(step.positions), meta

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        """A host-built step tensor on the device, copied without waiting for the device's
        queued work (pinned first; on the CPU, the tensor itself)."""
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def calibrate_kv_scales(self, token_ids: list[int], act_dtype: torch.dtype) -> None:
        """FP8 cache: set k/v scales from the K/V of one calibration batch (max over layers).

        The batch runs against a temporary cache in the model's dtype, so nothing is rounded
        before the scales are known.
        """
        if self.workers is not None:
            self.workers.broadcast("calibrate", (token_ids, act_dtype))
        bs = self.block_size
        n_blocks = -(-len(token_ids) // bs)
        tmp = torch.zeros((2, len(self.kv_caches), n_blocks, *self.kv.shape[3:]),
                          dtype=act_dtype, device=self.device)
        caches = [(tmp[0, i], tmp[1, i]) for i in range(len(self.kv_caches))]
        n = len(token_ids)
        bt = torch.arange(n_blocks, dtype=torch.int32, device=self.device)[None]
        seq_lens = torch.tensor([n], dtype=torch.int32, device=self.device)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=self.device)
        positions = torch.arange(n, device=self.device)
        meta = AttentionMetadata(slot_mapping=positions.clone(), block_tables=bt,
                                 seq_lens=seq_lens, query_start_loc=qsl, max_query_len=n,
                                 max_seq_len=n, backend=self.backend,
                                 plan=plan_attention(bt, seq_lens, qsl, bs, n, n))
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        self.model(ids, positions, caches, meta)
        self.k_scale = compute_kv_scale(tmp[0])
        self.v_scale = compute_kv_scale(tmp[1])
        tp = getattr(self.model, "tp", None)
        if tp is not None:  # every rank the scales of the whole model, as with one rank
            self.k_scale, self.v_scale = tp.all_reduce_max([self.k_scale, self.v_scale])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager, sample_rows: list[int],
                sampling: SamplingMetadata | None, prompt: PromptLogprobsPlan | None = None,
                lora_slots: list[int] | None = None, fill: Any = None,
                sample_offsets: list[int] | None = None
                ) -> tuple[SamplerOutput | None, PromptLogprobsResult | None]:
        """Run one step. `sample_rows[i]` is the batch index of the seq whose last scheduled
        token's logits feed sampler row i (an index may repeat: n > 1 forks); `prompt` names
        the rows whose prompt logprobs are computed too; `fill` (a StepFill) the input tokens
        the previous step sampled and the host has not read yet; `sample_offsets` (speculative
        decoding) each row's position back from its seq's last token. Nothing is read back."""
        step = self.build_step(sched, kv, sample_rows if sampling is not None else [],
                               lora_slots)
        step.sample_offsets = sample_offsets
        if fill is not None:
            if self.workers is not None:
                raise RuntimeError("async scheduling runs on one rank only")
            step.fill = fill
        if prompt is not None:
            step.prompt_rows, step.prompt_targets, step.prompt_k = \
                prompt.rows, prompt.targets, prompt.k
        # a graph runs no per-layer hook: a step loading a connector's blocks runs eagerly
        step.graph_size = None if step.moves.kv_meta else self.decode_graph_size(step)
        if self.link is not None and self.logits_hook is None:  # the last stage samples
            step.sampling = sampling
        if self.workers is None:
            logits, prompt_result = self.run_step(step)
        else:
            self.workers.broadcast("step", step)
            try:
                logits, prompt_result = self.run_step(step)
            except RuntimeError as exc:  # a collective whose peer died, most likely
                raise self.workers.failed(exc) from exc
            if self.link is not None:  # the last stage computed them
                logits, prompt_result = self.workers.receive_output()
                if isinstance(logits, SamplerOutput):  # it sampled too
                    return _on(logits, self.device), prompt_result
                if logits is not None:
                    logits = logits.to(self.device)
        if logits is None or sampling is None:
            return None, prompt_result
        if self.logits_hook is not None:  # custom logits processors (engine/llm_engine.py)
            logits = self.logits_hook(logits)
        return self.sampler(logits, sampling), prompt_result

    @torch.inference_mode()
    def run_step(self, step: StepInput) -> tuple[torch.Tensor | None,
                                                 PromptLogprobsResult | None]:
        """Every rank: move blocks, run the forward, and (rank 0) return the sampled rows'
        logits and the prompt logprobs asked; the other ranks only take part in the
        collectives."""
        self.apply_moves(step.moves)
        try:
            if self.link is not None:
                hidden = self._stage_forward(step)
                if hidden is None:  # not the last stage: sent on
                    return None, None
            else:
                self._set_lora(step)
                hidden, _ = self._forward(step)
        finally:
            if self.kv_connector is not None:  # its layer-by-layer loads: all landed
                self.kv_connector.wait_for_save()
        if self.keep_hidden:  # a proposer fed by hidden states (engine/spec_decode/)
            self.last_hidden = hidden
        logits = None
        if step.sample_rows:  # each sampled row's last token, found on the host
            last = step.query_start_loc[1:].long() - 1
            picked = last[torch.tensor(step.sample_rows, dtype=torch.int64)]
            if step.sample_offsets is not None:
                picked = picked - torch.tensor(step.sample_offsets, dtype=torch.int64)
            rows = self._dev(picked)
            logits = self.model.compute_logits(hidden[rows])
        prompt = None
        if step.prompt_rows:
            prompt = compute_prompt_logprobs(self.model, hidden, step.prompt_rows,
                                             step.prompt_targets, step.prompt_k)
        if step.sampling is not None and logits is not None:  # the last pipeline stage
            return self.sampler(logits, _on(step.sampling, self.device)), prompt
        return logits, prompt


    def _set_lora(self, step: StepInput) -> None:
        if self.lora is not None and step.graph_size is None:  # a graph reads its own buffer
            slots = step.lora_slots
            self.lora.set_indices(slots.to(self.device) if slots is not None else None)

    def _stage_forward(self, step: StepInput) -> torch.Tensor | None:
        """This pipeline stage's share of the step, micro-batch by micro-batch: each one's
        (hidden states, residual) sent on as soon as computed (the last stage: the hidden
        states of the whole step, in order; the others: None)."""
        from kvserve.engine.worker.microbatch import split_step

        link = self.link
        outs: list[torch.Tensor] = []
        sends: list[Any] = []
        for mb in split_step(step, link.microbatches):  # type: ignore[union-attr]
            self._set_lora(mb.step)
            hidden, _ = self._forward(mb.step)
            if link.next is not None:  # type: ignore[union-attr]
                sends.append(link.isend(*hidden))  # type: ignore[union-attr]
            else:
                outs.append(hidden)
        if sends:
            link.wait(sends)  # type: ignore[union-attr]
            return None
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int,
                              capture: Capture | None = None,
                              query_lens: tuple[int, ...] = ()) -> None:
        """Capture the decode forward for the ladder of batch sizes on every rank (`capture`: a
        stand-in for torch.cuda.CUDAGraph in the CPU tests, sent to the workers too, so picklable
        there; None: `cuda_capture`; `query_lens`: more tokens per sequence to capture, 1 + k for
        speculative decoding's verification; if those fail, every rank captures decode alone).
        Run after the fp8 scales are calibrated. All ranks keep their graphs or none does:
        RuntimeError naming the failed ranks, every rank eager."""
        failed = self._capture_everywhere(max_num_seqs, max_model_len, capture, query_lens)
        if failed and query_lens:
            logger.warning("CUDA graphs with %s tokens per sequence not captured (%s); "
                           "verification steps run eagerly", query_lens, "; ".join(failed))
            failed = self._capture_everywhere(max_num_seqs, max_model_len, capture, ())
        if failed:
            self.graphs = None
            if self.workers is not None:  # before any step: the pipes keep the order
                self.workers.broadcast("drop_graphs", None)
            raise RuntimeError("; ".join(failed))
        logger.info("%s", graphs_log_line(self.graphs))

    def _capture_everywhere(self, max_num_seqs: int, max_model_len: int,
                            capture: Capture | None, query_lens: tuple[int, ...]) -> list[str]:
        """Every rank's capture; the failed ones, named."""
        if self.workers is not None:
            self.workers.broadcast("capture", (max_num_seqs, max_model_len, capture, query_lens))
        errors: list[object] = [self.try_capture(max_num_seqs, max_model_len, capture,
                                                 query_lens)]
        if self.workers is not None:
            errors += self.workers.wait_for("captured")
        return [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None]

    def try_capture(self, max_num_seqs: int, max_model_len: int,
                    capture: Capture | None = None,
                    query_lens: tuple[int, ...] = ()) -> str | None:
        """This rank's capture (every rank, in the same order: the forward's collectives are
        recorded too); None when it worked, else why, with this rank left eager."""
        self.graphs = None
        width = -(-max_model_len // self.block_size)
        try:
            self.graphs = DecodeGraphs(
                self._graph_forward, max_num_seqs, width, self.block_size, self.device,
                capture or cuda_capture(), self.backend, self.k_scale, self.v_scale,
                tuple(query_lens))
        except Exception as exc:  # noqa: BLE001 - any failure leaves the rank eager
            self.graphs = None
            return f"{type(exc).__name__}: {exc}"
        return None

    def _graph_forward(self, ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, lora_slots: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:  # the static slot buffer: what the captured LoRA ops read
            self.lora.set_indices(lora_slots)
        return self.model(ids, positions, self.kv_caches, meta)

    def decode_graph_size(self, step: StepInput) -> int | None:
        """The captured size `step` replays (None: eager): a pure decode step of one KV-cache
        group (several run eagerly) without prompt logprobs, within the ladder; or a step of a
        captured query length (speculative verification, `step.graph_query_len` set). The
        driver decides it once and sends it with the step, so no rank decides on its own."""
        g = self.graphs
        step.graph_query_len = 1
        if g is None or self.link is not None or step.prompt_rows or step.embeds is not None \
                or step.block_tables.shape[0] != 1:
            return None
        n, width = step.seq_lens.shape[0], step.block_tables.shape[2]
        if step.input_ids.shape[0] == n:
            return g.size_for(n, n, width)
        q = self._graph_query_len(step, g)
        size = g.size_for(n, n * q, width, q) if q is not None else None
        if size is not None:
            step.graph_query_len = q
        return size

    def _graph_query_len(self, step: StepInput, g: DecodeGraphs) -> int | None:
        """The smallest captured query length > 1 that holds every sequence's tokens, when the
        step may be padded to it (cuda_graph.pad_to_uniform): no fresh prompt (the eager step
        sends those to another kernel), a padded length within the captured table width, and
        no device-supplied input unless nothing is padded (async fills index the real rows)."""
        fits = [q for q in g.query_lens if 1 < q and step.max_query_len <= q]
        if not fits:
            return None
        q = min(fits)
        q_lens = step.query_start_loc[1:] - step.query_start_loc[:-1]
        seq_lens = step.seq_lens
        if bool(((q_lens == seq_lens) & (q_lens > 1)).any()):
            return None
        if bool((q_lens != q).any()) and (
                step.fill is not None
                or int((seq_lens + (q - q_lens)).max()) > g.width * self.block_size):
            return None
        return q

    def _forward(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and query_start_loc (on the device): the captured graph the driver
        chose for this step (`step.graph_size`), the eager forward otherwise."""
        if step.graph_size is not None:
            if self.graphs is None:  # an error, never a collective run by some ranks only
                raise RuntimeError(f"the driver replays decode graph {step.graph_size}, which "
                                   "this rank did not capture")
            return self._replay(step), step.query_start_loc.to(self.device, non_blocking=True)
        ids, positions, meta = self.to_device(step)
        if self.link is not None and self.link.prev is not None:
            passed = self.link.recv(step.input_ids.shape[0])
            return (self.model(ids, positions, self.kv_caches, meta, intermediate=passed),
                    meta.query_start_loc)
        fill = self._fill(step)
        if fill is not None:
            fill(ids)
        if step.embeds is not None:
            embeds = (self._dev(step.embeds[0]), self._dev(step.embeds[1]))
            return (self.model(ids, positions, self.kv_caches, meta, embeds=embeds),
                    meta.query_start_loc)
        return self.model(ids, positions, self.kv_caches, meta), meta.query_start_loc

    def _replay(self, step: StepInput) -> torch.Tensor:
        """The step's hidden states from its captured graph, in the step's own row order."""
        q, graphs = step.graph_query_len, self.graphs
        assert graphs is not None  # _forward checked it
        b = pad_to_uniform(step.query_start_loc, q, step.input_ids, step.positions,
                           step.slot_mapping[0], step.seq_lens, step.lora_slots)
        hidden = graphs.run(b.input_ids, b.positions, b.slot_mapping, step.block_tables[0],
                            b.seq_lens, b.lora_slots, step.graph_size, self._fill(step), q)
        return hidden if b.rows is None else hidden[self._dev(b.rows)]

    def _fill(self, step: StepInput) -> Callable[[torch.Tensor], None] | None:
        """Writes the step's device-supplied tokens into a device ids tensor (no host read)."""
        f = step.fill
        if f is None:
            return None
        index = self._dev(torch.tensor(f.index, dtype=torch.int64))
        source = self._dev(torch.tensor(f.source, dtype=torch.int64))

        def write(ids: torch.Tensor) -> None:
            ids[index] = f.tokens[source].to(ids.dtype)
        return write


def _on(obj: Any, device: torch.device) -> Any:
    """A dataclass of tensors (and tuples of them) with every tensor on `device` (what another
    pipeline stage sent: its tensors unpickle onto the device index they left)."""
    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, tuple):
            return tuple(move(x) for x in v)
        return v
    return replace(obj, **{f.name: move(getattr(obj, f.name)) for f in fields(obj)})


def _moves(sched: SchedulerOutput) -> BlockMoves:
    return BlockMoves(list(sched.blocks_to_swap_out), list(sched.blocks_to_swap_in),
                      list(sched.blocks_to_copy), list(sched.blocks_to_offload),
                      list(sched.blocks_to_restore), list(sched.blocks_to_spill),
                      list(sched.blocks_to_load), sched.kv_connector_metadata)
