"""RMSNorm, computed the way HF Llama/Qwen compute it (fp32 variance, weight applied last)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The variance is taken in fp32 whatever the input dtype, and the normalised value is cast
    back to the input dtype before the weight multiplies it, exactly as in HF ``LlamaRMSNorm``.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        if dim <= 0 or eps <= 0:
            raise ValueError(f"RMSNorm needs dim > 0 and eps > 0, got dim={dim}, eps={eps}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; same maths as below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in fp32, then cast back (Qwen3-Next,
    Gemma): the stored weight is an offset from one, so a zero weight is the identity scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        if dim <= 0 or eps <= 0:
            raise ValueError(f"RMSNorm needs dim > 0 and eps > 0, got dim={dim}, eps={eps}")
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
