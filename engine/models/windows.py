"""Which layers slide: config.layer_types (HF's per-layer "sliding_attention"/"full_attention")
with config.sliding_window, or every layer when a family has a window but no layer_types."""

from __future__ import annotations

from kvserve.engine.errors import ConfigError

LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(config, all_layers_slide: bool = False) -> tuple[int | None, ...]:
    """The window of each layer (None = full attention), () when no layer slides."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        return (window,) * n if window and all_layers_slide else ()
    if len(types) != n:
        raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not supported (kvserve implements "
                          f"{list(LAYER_TYPES)})")
    if "sliding_attention" in types and not window:
        raise ConfigError("layer_types names sliding_attention layers but sliding_window is "
                          f"{window!r}")
    if "sliding_attention" not in types:
        return ()
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
