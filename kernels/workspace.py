"""Scratch buffers reused by every layer of a step: the hot loop does not fault in fresh memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Workspace:
    """Named flat buffers, grown on demand; a view of the first `numel` elements is handed out.

    One per plan (one step): calls reuse it one after another, never concurrently.
    """

    device: torch.device
    buffers: dict[tuple[str, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        key = (name, dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)
