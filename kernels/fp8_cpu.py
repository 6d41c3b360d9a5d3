"""Fast e4m3 -> fp16 on the CPU: torch's own fp8 conversion is scalar, one value at a time.

The e4m3 bit pattern shifted left by 7 is an fp16 with the same sign, mantissa and exponent field,
read with fp16's bias (15) instead of e4m3's (7): exactly the value times 2^-8, subnormals
included. Callers fold the 2^8 into their scale. Three vectorised passes replace the scalar
conversion (the speed-up is in docs/perf.md).
"""

from __future__ import annotations

import torch

FP8_TO_FP16_FACTOR = 256.0  # true value = fp16 result * FP8_TO_FP16_FACTOR
_CLEAR_BIT_14 = -16385  # 0xBFFF as int16: drops the sign-extension bit the shift leaves behind


def fp8_bytes_to_fp16(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3 values given as uint8 bytes -> fp16 holding value / 256 (exact; NaN not supported)."""
    bits = out.view(torch.int16) if out is not None else torch.empty(raw.shape, dtype=torch.int16)
    bits.copy_(raw.view(torch.int8))  # sign-extends: negative bytes get a high byte of ones
    bits.bitwise_left_shift_(7).bitwise_and_(_CLEAR_BIT_14)
    return bits.view(torch.float16)
