"""DFlash-style block drafter: a small transformer that reads the target's hidden states.

Inputs per request:

* context: the target's hidden states after ``target_layers`` (several layers spread through the
  network) for the last ``context_window`` computed tokens, concatenated and fused by a linear
  projection and an RMSNorm (:meth:`DFlashDrafter.fuse`, done once per token);
* block: ``[last verified token, MASK x (block_size - 1)]`` at the next ``block_size``
  positions: the token through the target's own embedding, MASK a learned vector.

Every drafter layer projects the fused context to extra keys/values (with that layer's own K/V
projections) in front of the block's; the block's queries attend to all of the context and to
every block position (non-causal inside the block), with RoPE by absolute position. The final
norm's output goes through the target's LM head (shared, not stored), so block position ``j``
(``1 .. block_size - 1``) gives the distribution of the token ``j`` places after the verified
one: a whole block of drafts from one pass.

Checkpoint: a directory with ``config.json`` (:class:`DrafterConfig`) and ``model.safetensors``
(fp16; tensor names in :meth:`DFlashDrafter.expected_shapes`). :func:`load_drafter` refuses a
checkpoint that does not fit the target, naming the problem.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.contracts.errors import ModelLoadError

ARCHITECTURE = "DFlashDrafter"


@dataclass
class DrafterConfig:
    target_hidden_size: int
    vocab_size: int
    target_layers: list[int]
    hidden_size: int
    num_layers: int = 1
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    block_size: int = 8
    context_window: int = 96
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    target_model: str = ""           # name of the target it was trained for (informational)
    architecture: str = ARCHITECTURE
    training: dict = field(default_factory=dict)   # how it was made (informational)

    def __post_init__(self) -> None:
        if self.architecture != ARCHITECTURE:
            raise ModelLoadError(f"drafter config: architecture {self.architecture!r} is not {ARCHITECTURE!r}")
        for name in ("target_hidden_size", "vocab_size", "hidden_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "intermediate_size", "context_window"):
            if int(getattr(self, name)) < 1:
                raise ModelLoadError(f"drafter config: {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ModelLoadError(f"drafter config: block_size must be >= 2, got {self.block_size}")
        if not self.target_layers:
            raise ModelLoadError("drafter config: target_layers is empty")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"drafter config: num_heads {self.num_heads} is not a multiple of "
                                 f"num_kv_heads {self.num_kv_heads}")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE; ``x`` [R, heads, L, D], ``pos`` [R, L]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[..., None] * inv                       # [R, L, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class _Layer(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.c = c
        self.input_layernorm = _RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.post_attention_layernorm = _RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        c = self.c
        r, b, _ = x.shape
        w = ctx.shape[1]
        hx = self.input_layernorm(x)
        kv_in = torch.cat([ctx, hx], dim=1)                  # context K/V first, then the block
        q = self.q_proj(hx).view(r, b, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(kv_in).view(r, w + b, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(kv_in).view(r, w + b, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q = _rope(q, pos[:, w:], c.rope_theta)
        k = _rope(k, pos, c.rope_theta)
        rep = c.num_heads // c.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        x = x + self.o_proj(o.transpose(1, 2).reshape(r, b, -1))
        hx = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(hx)) * self.up_proj(hx))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.fusion_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mask_embed = nn.Parameter(torch.zeros(c.hidden_size))
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self.state_dict().items()}

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target hidden states [..., len(target_layers) * target_hidden] -> fused [..., hidden]."""
        return self.fusion_norm(self.fc(hidden))

    def forward(self, ctx: torch.Tensor, ctx_valid: torch.Tensor, first_embed: torch.Tensor,
                start_pos: torch.Tensor) -> torch.Tensor:
        """Block hidden states [R, block_size, hidden] (after the final norm).

        ``ctx`` [R, W, hidden] fused context (left-padded), ``ctx_valid`` [R, W] bool,
        ``first_embed`` [R, hidden] target embedding of each block's verified token,
        ``start_pos`` [R] its position; the context holds the positions just before it.
        """
        c = self.config
        r, w, _ = ctx.shape
        b = c.block_size
        x = torch.cat([first_embed[:, None], self.mask_embed.expand(r, b - 1, -1)], dim=1).to(ctx.dtype)
        offs = torch.arange(-w, b, device=ctx.device)
        pos = (start_pos[:, None] + offs).clamp(min=0)
        mask = torch.cat([ctx_valid, torch.ones(r, b, dtype=torch.bool, device=ctx.device)], dim=1)
        for layer in self.layers:
            x = layer(x, ctx, pos, mask)
        return self.norm(x)


def init_drafter(config: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(config)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[1]))
    for layer in model.layers:   # start close to the identity: residual branches small
        layer.o_proj.weight.data *= 0.1
        layer.down_proj.weight.data *= 0.1
    return model


def save_drafter(model: DFlashDrafter, out_dir: str | Path) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save(out / "config.json")
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()},
              str(out / "model.safetensors"))


def load_drafter(path: str | Path, *, target_hidden_size: int, vocab_size: int, target_num_layers: int,
                 dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Load and check a drafter directory against the target; ModelLoadError names any mismatch."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "config.json").is_file():
        raise ModelLoadError(f"drafter {d}: no config.json (expected a directory from tokenmill train-drafter)")
    try:
        raw = json.loads((d / "config.json").read_text())
        config = DrafterConfig(**raw)
    except (json.JSONDecodeError, TypeError) as e:
        raise ModelLoadError(f"drafter {d}: bad config.json: {e}") from None
    if config.target_hidden_size != target_hidden_size:
        raise ModelLoadError(f"drafter {d}: built for target hidden size {config.target_hidden_size}, "
                             f"but the target's hidden size is {target_hidden_size}")
    if config.hidden_size != target_hidden_size:
        raise ModelLoadError(f"drafter {d}: hidden size {config.hidden_size} must equal the target's "
                             f"{target_hidden_size} (it shares the target's embedding and LM head)")
    if config.vocab_size != vocab_size:
        raise ModelLoadError(f"drafter {d}: vocabulary size {config.vocab_size} does not match the "
                             f"target's {vocab_size}")
    bad = [i for i in config.target_layers if not 0 <= i < target_num_layers]
    if bad:
        raise ModelLoadError(f"drafter {d}: target_layers {bad} do not exist in a {target_num_layers}-layer target")
    if not (d / "model.safetensors").is_file():
        raise ModelLoadError(f"drafter {d}: no model.safetensors")
    try:
        weights = load_file(str(d / "model.safetensors"))
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"drafter {d}: cannot read model.safetensors: {e}") from None
    model = DFlashDrafter(config)
    expected = model.expected_shapes()
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"drafter {d}: missing tensor(s) {', '.join(missing[:5])}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ModelLoadError(f"drafter {d}: unexpected tensor(s) {', '.join(extra[:5])}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"drafter {d}: tensor {name} has shape {tuple(weights[name].shape)}, "
                                 f"expected {shape} from config.json")
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    return model.to(dtype).eval().requires_grad_(False)
