"""The per-tensor scale rule (jaxamp/_src/placement/tensor_scale.py) in PyTorch: a power-of-two scale per matmul
operand from its own amax, the scaled operands cast to float16 or FP8, the product accumulated
in float32 and unscaled. Written from docs/algorithm.md's rule, not from jaxamp's code."""

import math

import torch

__all__ = ["ROLES", "FP8_FORMATS", "MARGIN_LOG2", "scale_for", "rounded_each", "scaled_matmul"]

ROLES = ("value", "tangent", "cotangent")
FP8_FORMATS = (torch.float16, torch.float16, torch.float8_e4m3fn)  # jaxamp's recipe
MARGIN_LOG2 = 1


def scale_for(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**e with ``max|x| * 2**e`` in ``(2**(emax - MARGIN_LOG2 - 1), 2**(emax - MARGIN_LOG2)]``,
    e clipped to [-126, 126]; 1 for an all-zero or non-finite ``x``."""
    amax = x.detach().abs().max().float() if x.numel() else torch.tensor(0.0)
    if not bool(torch.isfinite(amax)) or float(amax) == 0.0:
        return torch.tensor(1.0)
    emax = math.floor(math.log2(torch.finfo(dtype).max))
    e = min(max(emax - MARGIN_LOG2 - math.ceil(math.log2(float(amax))), -126), 126)
    return torch.tensor(2.0**e, dtype=torch.float32)


def rounded_each(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) with each entry rounded to ``dtype`` under its own power-of-two scale (the
    rule for an outer product, a contraction of length 1): ``dtype``'s precision, float32's range."""
    x = x.float()
    emax = math.floor(math.log2(torch.finfo(dtype).max))
    mag = x.abs()
    ok = torch.isfinite(mag) & (mag > 0)
    _, exp = torch.frexp(torch.where(ok, mag, torch.ones_like(mag)))  # mag = m * 2**exp, m in [0.5, 1)
    ceil_log2 = exp - (torch.where(ok, mag, torch.ones_like(mag)) == torch.ldexp(torch.ones_like(mag), exp - 1)).int()
    e = torch.where(ok, torch.clamp(emax - MARGIN_LOG2 - ceil_log2, -126, 126), torch.zeros_like(exp))
    scale = torch.ldexp(torch.ones_like(mag), e)
    return (x * scale).to(dtype).float() / scale


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``a @ b`` on operands scaled and cast to ``dtype``, accumulated in float32, unscaled."""
    if a.shape[-1] == 1:  # an outer product: each entry its own scale (no sum for one scale to serve)
        held = (x.float() if x.dtype == dtype else rounded_each(x, dtype) for x in (a, b))
        return torch.matmul(*held)
    # an operand already held in ``dtype`` keeps scale 1: its products are exact in float32
    sa, sb = (torch.tensor(1.0) if x.dtype == dtype else scale_for(x, dtype) for x in (a, b))
    low_a = (a.float() * sa).to(dtype).float()
    low_b = (b.float() * sb).to(dtype).float()
    # unscaled by 2**-(ea + eb) in two halves: the whole may lie outside float32's exponent range
    e = round(math.log2(float(sa))) + round(math.log2(float(sb)))
    half = e // 2
    return (low_a @ low_b) * 2.0**-half * 2.0 ** (half - e)
