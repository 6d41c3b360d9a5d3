"""Write a compressed-tensors checkpoint of the default model (or any dense HF folder) with
compressed-tensors' own code and no calibration data: min-max scales (its calculate_qparams),
packing by its compressors, config.json from its QuantizationConfig; lm_head left dense.

    python bench/make_quantized.py OUT [--scheme W4A16|W8A8|W8A16|FP8_DYNAMIC] [--group 64]
                                       [--model FOLDER]

W4A16 needs a group that divides every linear's input width (the default model: 576 and 1536,
so 64 or 32, not 128). The engine then serves OUT with `LLM(OUT)` / `kvserve serve OUT`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def scheme_args(scheme: str, group: int) -> tuple[str, dict, dict | None]:
    token = dict(num_bits=8, symmetric=True, strategy="token", dynamic=True)
    return {
        "W4A16": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True,
                                         strategy="group", group_size=group), None),
        "W8A16": ("pack-quantized", dict(num_bits=8, type="int", symmetric=True,
                                         strategy="channel"), None),
        "W8A8": ("int-quantized", dict(num_bits=8, type="int", symmetric=True,
                                       strategy="channel"), dict(type="int", **token)),
        "FP8_DYNAMIC": ("float-quantized", dict(num_bits=8, type="float", symmetric=True,
                                                strategy="channel"), dict(type="float", **token)),
    }[scheme]


def qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.quantization.utils import calculate_qparams

    out, cols = weight.shape
    if args.strategy == "group":
        view = weight.view(out, cols // args.group_size, args.group_size)
        return calculate_qparams(view.amin(-1), view.amax(-1), args)
    return calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True), args)


def write(dense: Path, out: Path, scheme: str, group: int = 64) -> Path:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, \
        QuantizationScheme, QuantizationStatus
    from safetensors.torch import load_file, save_file

    fmt, w_args, a_args = scheme_args(scheme, group)
    q = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**w_args),
                           input_activations=a_args and QuantizationArgs(**a_args))
    compressor = BaseCompressor.load_from_registry(fmt)
    shutil.copytree(dense, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in sorted(dense.glob("*.safetensors")):
        state = {}
        for name, tensor in load_file(str(file)).items():
            prefix, _, leaf = name.rpartition(".")
            if leaf != "weight" or prefix.rpartition(".")[2] not in LINEARS:
                state[name] = tensor
                continue
            scale, zero = qparams(tensor.float(), q.weights)
            module = {"weight": tensor.float(), "weight_scale": scale, "weight_zero_point": zero}
            state.update({f"{prefix}.{k}": v.contiguous()
                          for k, v in compressor.compress(module, q).items()})
        save_file(state, str(out / file.name), metadata={"format": "pt"})
    config = QuantizationConfig(config_groups={"group_0": q}, format=fmt, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.COMPRESSED)
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {**config.model_dump(mode="json"),
                                  "quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--scheme", default="W4A16", choices=("W4A16", "W8A16", "W8A8", "FP8_DYNAMIC"))
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--model", type=Path, default=None, help="dense HF folder (default model)")
    args = ap.parse_args()
    if args.model is None:
        from kvserve.engine.worker.model_loader import fetch_model

        args.model = fetch_model("smollm2-135m-instruct")
    print(write(args.model, args.out, args.scheme, args.group))


if __name__ == "__main__":
    main()
