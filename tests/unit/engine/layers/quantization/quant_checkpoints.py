"""Tiny quantised checkpoints built in the tests: a random dense Llama quantised with
compressed-tensors' own code (scales from its calculate_qparams, packing by its compressors,
config.json from its QuantizationConfig), plus the dense reference with the dequantised weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "w1", "w2", "w3")  # w1 / w2 / w3: Mixtral's experts (block_sparse_moe.experts.N)

SCHEMES = {  # name -> (format, weights args, input activation args)
    "W8A8": ("int-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
             dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),
    "W4A16": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                     group_size=32), None),
    "W4A16_ASYM": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False,
                                          strategy="group", group_size=32), None),
    "W8A16": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True,
                                     strategy="channel"), None),
    "FP8_DYNAMIC": ("float-quantized", dict(num_bits=8, type="float", symmetric=True,
                                            strategy="channel"),
                    dict(num_bits=8, type="float", symmetric=True, strategy="token",
                         dynamic=True)),
    "FP8_BLOCK": ("float-quantized", dict(num_bits=8, type="float", symmetric=True,
                                          strategy="block", block_structure=[32, 32]), None),
}


def _qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' min-max scales and zero points for a weight under `args`."""
    from compressed_tensors.quantization.utils import calculate_qparams

    out, cols = weight.shape
    if args.strategy == "group":
        view = weight.view(out, cols // args.group_size, args.group_size)
        lo, hi = view.amin(-1), view.amax(-1)
    elif args.strategy == "block":
        b0, b1 = args.block_structure
        view = weight.view(out // b0, b0, cols // b1, b1)
        lo, hi = view.amin((1, 3)), view.amax((1, 3))
    else:  # channel
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    scale, zero = calculate_qparams(lo, hi, args)
    return scale, zero


def write_quantized(dense_dir: Path, out_dir: Path, scheme: str,
                    reference_dir: Path | None = None,
                    ignore: tuple[str, ...] = ("lm_head",),
                    targets: tuple[str, ...] = ("Linear",)) -> Path:
    """Quantise `dense_dir`'s linears (those of LINEARS: an MoE's experts too, not its router
    `mlp.gate`) into a compressed-tensors checkpoint whose config targets `targets` (which must
    name every one of them) and ignores `ignore`; with `reference_dir`, also save the dense model
    whose weights are the dequantised ones."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, \
        QuantizationScheme, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from safetensors.torch import load_file, save_file

    fmt, w_args, a_args = SCHEMES[scheme]
    q_scheme = QuantizationScheme(targets=list(targets), weights=QuantizationArgs(**w_args),
                                  input_activations=a_args and QuantizationArgs(**a_args))
    compressor = BaseCompressor.load_from_registry(fmt)
    state = load_file(str(dense_dir / "model.safetensors"))
    out_state, ref_state = {}, dict(state)
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
            out_state[name] = tensor
            continue
        scale, zero = _qparams(tensor, q_scheme.weights)
        module = {"weight": tensor, "weight_scale": scale, "weight_zero_point": zero}
        for key, value in compressor.compress(module, q_scheme).items():
            out_state[f"{prefix}.{key}"] = value.contiguous()
        ref_state[name] = fake_quantize(tensor, scale, zero, q_scheme.weights)
    _save(dense_dir, out_dir, out_state, save_file)
    config = QuantizationConfig(config_groups={"group_0": q_scheme}, format=fmt,
                                ignore=list(ignore),
                                quantization_status=QuantizationStatus.COMPRESSED)
    raw = json.loads((out_dir / "config.json").read_text())
    raw["quantization_config"] = {**config.model_dump(mode="json"),
                                  "quant_method": "compressed-tensors"}
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    if reference_dir is not None:
        _save(dense_dir, reference_dir, ref_state, save_file)
    return out_dir


def _save(src: Path, dst: Path, state: dict, save_file) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 100, 7, 9, 250, 31], [1, 300, 301, 302]]


def engine_greedy(llm, max_tokens: int = 12) -> list[tuple[list[int], list[float]]]:
    """(generated ids, logprob of each) for PROMPTS, greedy."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1,
                            ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        result.append((list(c.token_ids), logprobs))
    return result


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def teacher_forced(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab] log-probabilities of the reference at each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
