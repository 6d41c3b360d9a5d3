"""Writers of GPTQ, AWQ and native block-FP8 checkpoints in each format's own layout, from a
tiny dense model: our own reference quantiser and bit packing (written from the formats'
definitions, independently of the engine's readers), plus the dense model with the dequantised
weights to compare against. gptqmodel / autoawq do not run on this CPU-only machine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "w1", "w2", "w3")  # w1 / w2 / w3: Mixtral's experts (block_sparse_moe.experts.N)


def pack_words(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned codes [rows, n] -> int32 [rows, n * bits / 32]: element j of each run of
    32 / bits at bits * j, or (AWQ) element order[j] at bits * j."""
    per = 32 // bits
    rows, n = codes.shape
    runs = codes.long().view(rows, n // per, per)
    if order is not None:
        runs = runs[:, :, list(order)]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (runs << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def asym_quantise(w: torch.Tensor, groups: torch.Tensor, n_groups: int, bits: int,
                  sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max quantisation of w [out, in] with column c in group groups[c]: (unsigned codes
    [out, in], fp16 scales [out, n_groups], integer zeros [out, n_groups])."""
    maxq = (1 << bits) - 1
    out = w.shape[0]
    scale = torch.empty(out, n_groups)
    zero = torch.empty(out, n_groups)
    for g in range(n_groups):
        cols = w[:, groups == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        scale[:, g] = ((hi - lo) / maxq).clamp_min(1e-6)
        # GPTQ v1 stores zero - 1, so keep zero >= 1 (a zero of 0 cannot be stored in v1)
        zero[:, g] = (1 << (bits - 1)) if sym else torch.round(-lo / scale[:, g]).clamp(1, maxq)
    scale = scale.half().float()  # the formats store fp16 scales
    s, z = scale[:, groups], zero[:, groups]
    codes = torch.clamp(torch.round(w / s) + z, 0, maxq)
    return codes.to(torch.int32), scale, zero


def write_gptq(dense: Path, out: Path, bits: int, group: int, desc_act: bool, sym: bool,
               reference: Path) -> Path:
    def convert(name: str, w: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
        n_in = w.shape[1]
        group_width = n_in if group == -1 else group  # -1: one group per output channel
        if desc_act:  # columns join groups in a shuffled order
            perm = torch.randperm(n_in, generator=torch.Generator().manual_seed(seed))
            g_idx = torch.empty(n_in, dtype=torch.int32)
            g_idx[perm] = (torch.arange(n_in) // group_width).to(torch.int32)
        else:
            g_idx = (torch.arange(n_in) // group_width).to(torch.int32)
        codes, scale, zero = asym_quantise(w, g_idx, n_in // group_width, bits, sym)
        deq = (codes - zero[:, g_idx]) * scale[:, g_idx]
        stored_zero = (zero - 1).to(torch.int32)  # v1: zero - 1
        return {"qweight": pack_words(codes, bits).t(),  # packed along the input dim
                "qzeros": pack_words(stored_zero.t().contiguous(), bits),  # along the output dim
                "scales": scale.t().half(), "g_idx": g_idx}, deq

    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
              "sym": sym, "checkpoint_format": "gptq"}
    return _write(dense, out, reference, config, convert)


def set_quant_config(folder: Path, **changes) -> None:
    """Change fields of a written checkpoint's quantization_config (refusal tests)."""
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def _input_seed(prefix: str) -> int:
    """One seed per linear input: projections that read the same activations (q/k/v, gate/up)
    get the same act order, as GPTQ's Hessian of that input gives them."""
    for a, b in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj"),
                 (".w3", ".w1")):
        prefix = prefix.replace(a, b)
    return sum(map(ord, prefix)) * 31 % 100003


def _write(dense: Path, out: Path, reference: Path, config: dict, convert) -> Path:
    from safetensors.torch import load_file, save_file

    state = load_file(str(dense / "model.safetensors"))
    q_state, ref_state = {}, dict(state)
    for name, tensor in sorted(state.items()):
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            q_state[name] = tensor
            continue
        tensors, deq = convert(name, tensor.float(), _input_seed(prefix))
        q_state.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
        ref_state[name] = deq.to(tensor.dtype)
    for dst, st in ((out, q_state), (reference, ref_state)):
        shutil.copytree(dense, dst, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(st, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def write_awq(dense: Path, out: Path, group: int, reference: Path) -> Path:
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def convert(name: str, w: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
        groups = torch.arange(w.shape[1]) // group
        codes, scale, zero = asym_quantise(w, groups, w.shape[1] // group, 4, False)
        deq = (codes - zero[:, groups]) * scale[:, groups]
        return {"qweight": pack_words(codes.t().contiguous(), 4, order),  # along the output dim
                "qzeros": pack_words(zero.t().contiguous().to(torch.int32), 4, order),
                "scales": scale.t().half()}, deq

    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    return _write(dense, out, reference, config, convert)


def write_fp8_block(dense: Path, out: Path, block: int, reference: Path) -> Path:
    def convert(name: str, w: torch.Tensor, seed: int) -> tuple[dict, torch.Tensor]:
        rows, cols = w.shape
        blocks = w.view(rows // block, block, cols // block, block)
        scale = blocks.abs().amax((1, 3)) / 448.0  # [rows / b, cols / b]
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        codes = (w / full).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale_inv": scale}, codes.float() * full

    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": [block, block]}
    return _write(dense, out, reference, config, convert)
