"""Accelerator specs for the capacity planner.

Every preset number sits next to the public document it comes from (``sources``), and a number
that is derived or assumed says so in ``notes``. All figures are **per device**: one GPU, or one
JAX device of a TPU v7x chip (a v7x chip exposes two devices, so its chip figures are halved).

Units: bytes, bytes/s and FLOP/s (decimal: 1 GB = 1e9 B, 1 TB/s = 1e12 B/s). FLOP/s are dense
(no structured sparsity). ``interconnect_bw`` is the unidirectional bandwidth one device can inject
into the scale-up network (NVLink, ICI).

``cpu-local`` has no preset numbers: :func:`measure_cpu_local` measures this machine's memory
bandwidth and matmul FLOP/s on the spot (numpy, and torch for bf16 when it can be imported).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Mapping

PRECISIONS = ("fp4", "fp8", "bf16", "fp16", "fp32")


class PlanError(ValueError):
    """Bad planner input (unknown preset, inconsistent flags). The CLI prints it and exits 2."""


@dataclass(frozen=True)
class HardwareSpec:
    """One device's memory, bandwidth and compute, with where each number comes from.

    ``peak_flops`` maps a precision name (see ``PRECISIONS``) to dense FLOP/s; a precision the
    device cannot run natively is absent. ``torus`` is the default ICI torus shape used for the
    all-to-all hop factor (None: a switched network, one hop).
    """

    name: str
    description: str
    hbm_bytes: float
    hbm_bw: float
    peak_flops: Mapping[str, float]
    interconnect_bw: float | None
    interconnect_name: str
    sources: Mapping[str, str]
    notes: tuple[str, ...] = ()
    torus: tuple[int, ...] | None = None
    measured: bool = False

    def __post_init__(self) -> None:
        if self.hbm_bytes <= 0 or self.hbm_bw <= 0:
            raise PlanError(f"{self.name}: memory capacity and bandwidth must be positive")
        if not self.peak_flops:
            raise PlanError(f"{self.name}: needs at least one peak FLOP/s figure")
        for prec, value in self.peak_flops.items():
            if prec not in PRECISIONS:
                raise PlanError(f"{self.name}: unknown precision {prec!r}; use one of {PRECISIONS}")
            if value <= 0:
                raise PlanError(f"{self.name}: peak FLOP/s for {prec} must be positive")
        if self.interconnect_bw is not None and self.interconnect_bw <= 0:
            raise PlanError(f"{self.name}: interconnect bandwidth must be positive")
        if self.torus is not None and (not self.torus or any(d < 1 for d in self.torus)):
            raise PlanError(f"{self.name}: torus dimensions must be positive integers")

    def flops(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision``; a clear error when the device lacks it."""
        if precision not in self.peak_flops:
            have = ", ".join(sorted(self.peak_flops))
            raise PlanError(f"hardware {self.name} has no {precision} peak (it lists: {have}); "
                            f"choose --compute-dtype from those")
        return self.peak_flops[precision]

    def with_overrides(self, *, hbm_bytes: float | None = None, hbm_bw: float | None = None,
                       interconnect_bw: float | None = None) -> HardwareSpec:
        """Copy with user-supplied numbers replacing the preset's (the source says so)."""
        sources = dict(self.sources)
        kwargs: dict[str, float] = {}
        for key, value in (("hbm_bytes", hbm_bytes), ("hbm_bw", hbm_bw),
                           ("interconnect_bw", interconnect_bw)):
            if value is not None:
                if value <= 0:
                    raise PlanError(f"override for {key} must be positive, got {value}")
                kwargs[key] = value
                sources[key] = "given on the command line"
        return replace(self, sources=sources, **kwargs) if kwargs else self


_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (https://www.nvidia.com/en-us/data-center/h100/)"
_NV_H200 = "NVIDIA H200 Tensor Core GPU product page / datasheet, SXM column (https://www.nvidia.com/en-us/data-center/h200/)"
_NV_DGX_B200 = "NVIDIA DGX B200 datasheet, 8-GPU system figures / 8 (https://www.nvidia.com/en-us/data-center/dgx-b200/)"
_NV_HGX = "NVIDIA HGX platform spec table, HGX B300 column, 8-GPU figures / 8 (https://www.nvidia.com/en-us/data-center/hgx/)"
_NV_NVLINK = "NVIDIA NVLink page: 5th gen 1.8 TB/s, 4th gen 900 GB/s per GPU, bidirectional (https://www.nvidia.com/en-us/data-center/nvlink/)"
_GOOGLE_V7X = "Google Cloud TPU7x (Ironwood) documentation (https://cloud.google.com/tpu/docs/tpu7x); same chip figures in seed 003's appendix"

_HOPPER_FLOPS = {"fp8": 1979e12, "bf16": 989.5e12, "fp16": 989.5e12, "fp32": 67e12}
_HOPPER_FLOP_NOTE = ("datasheet FP8/BF16 figures are with 2:4 sparsity; the dense values used here are half "
                     "of them (3,958 -> 1,979 and 1,979 -> 989.5 TFLOP/s); fp32 is the non-tensor-core FP32 figure")

PRESETS: dict[str, HardwareSpec] = {
    "h100": HardwareSpec(
        name="h100", description="NVIDIA H100 SXM5 80 GB",
        hbm_bytes=80e9, hbm_bw=3.35e12, peak_flops=_HOPPER_FLOPS,
        interconnect_bw=450e9, interconnect_name="NVLink 4 (900 GB/s bidirectional)",
        sources={"hbm_bytes": _NV_H100, "hbm_bw": _NV_H100, "peak_flops": _NV_H100,
                 "interconnect_bw": _NV_NVLINK},
        notes=(_HOPPER_FLOP_NOTE, "interconnect_bw is one direction: 900 GB/s bidirectional / 2"),
    ),
    "h200": HardwareSpec(
        name="h200", description="NVIDIA H200 SXM 141 GB",
        hbm_bytes=141e9, hbm_bw=4.8e12, peak_flops=_HOPPER_FLOPS,
        interconnect_bw=450e9, interconnect_name="NVLink 4 (900 GB/s bidirectional)",
        sources={"hbm_bytes": _NV_H200, "hbm_bw": _NV_H200, "peak_flops": _NV_H200,
                 "interconnect_bw": _NV_NVLINK},
        notes=(_HOPPER_FLOP_NOTE, "interconnect_bw is one direction: 900 GB/s bidirectional / 2"),
    ),
    "b200": HardwareSpec(
        name="b200", description="NVIDIA B200 (as in DGX/HGX B200), 180 GB HBM3e",
        hbm_bytes=180e9, hbm_bw=8e12,
        peak_flops={"fp4": 9e15, "fp8": 4.5e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp32": 75e12},
        interconnect_bw=900e9, interconnect_name="NVLink 5 (1.8 TB/s bidirectional)",
        sources={"hbm_bytes": _NV_DGX_B200 + ": 1,440 GB total", "hbm_bw": _NV_DGX_B200 + ": 64 TB/s total",
                 "peak_flops": _NV_DGX_B200 + ": 144 PFLOPS FP4 / 72 PFLOPS FP8, both sparse",
                 "interconnect_bw": _NV_NVLINK},
        notes=("dense FLOP/s are half the sparse datasheet figures; bf16 = fp8 / 2 and fp32 = 75 TFLOP/s "
               "are assumptions from the Blackwell ratios, not datasheet lines",
               "seed 000 uses the same 180 GB per GPU",
               "interconnect_bw is one direction: 1.8 TB/s bidirectional / 2"),
    ),
    "b300": HardwareSpec(
        name="b300", description="NVIDIA B300 (Blackwell Ultra, as in HGX B300), 288 GB HBM3e",
        hbm_bytes=288e9, hbm_bw=8e12,
        peak_flops={"fp4": 13.5e15, "fp8": 4.5e15, "bf16": 2.25e15, "fp16": 2.25e15, "fp32": 75e12},
        interconnect_bw=900e9, interconnect_name="NVLink 5 (1.8 TB/s bidirectional)",
        sources={"hbm_bytes": _NV_HGX + ": 2.3 TB total", "hbm_bw": _NV_HGX,
                 "peak_flops": _NV_HGX + ": FP4 108 PFLOPS dense, FP8 72 PFLOPS sparse",
                 "interconnect_bw": _NV_NVLINK},
        notes=("hbm_bw 8 TB/s per GPU is an assumption (same HBM3e stack rate as B200)",
               "fp8 dense = half the sparse figure; bf16 and fp32 are assumptions from Blackwell ratios",
               "interconnect_bw is one direction: 1.8 TB/s bidirectional / 2"),
    ),
    "tpu-v7x": HardwareSpec(
        name="tpu-v7x", description="Google TPU v7x (Ironwood), one of the two JAX devices of a chip",
        hbm_bytes=96e9, hbm_bw=3.69e12,
        peak_flops={"fp8": 2.307e15, "bf16": 1.1535e15},
        interconnect_bw=200e9, interconnect_name="ICI (1.2 TB/s bidirectional per chip)",
        sources={"hbm_bytes": _GOOGLE_V7X + ": 192 GB per chip",
                 "hbm_bw": _GOOGLE_V7X + ": 7.38 TB/s per chip",
                 "peak_flops": _GOOGLE_V7X + ": 4,614 TFLOP/s fp8 per chip",
                 "interconnect_bw": "seed 003 (MoE cost model): 1.2 TB/s bidirectional ICI per chip",
                 "torus": "seed 003: 16-chip slice, 2x2x4 ICI torus"},
        notes=("per-device figures are chip figures / 2: each chip is exposed as two devices (seed 003)",
               "bf16 = fp8 / 2 is an assumption from the usual ratio",
               "interconnect_bw is the seed's derivation, an assumption: ~100 GB/s per link per direction, "
               "4 usable links per chip in a 2x2x4 torus = 400 GB/s, shared by 2 devices = 200 GB/s"),
        torus=(2, 2, 4),
    ),
}

HARDWARE_NAMES = tuple(PRESETS) + ("cpu-local",)


def _best_time(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_cpu_local(array_mb: int = 64, matmul_n: int = 512, repeats: int = 5) -> HardwareSpec:
    """Measure this machine: RAM size, copy bandwidth (numpy) and matmul FLOP/s.

    Bandwidth counts read + write bytes of ``np.copyto`` on two ``array_mb`` MB arrays (best of
    ``repeats``). fp32 FLOP/s is a numpy ``matmul_n``-square matmul; bf16 FLOP/s is a torch bf16
    matmul when torch can be imported. The figures are what this process saw just now, on a shared
    machine they are a floor for the hardware, not its datasheet peak.
    """
    import numpy as np
    import psutil

    if array_mb < 1 or matmul_n < 16 or repeats < 1:
        raise PlanError("cpu-local measurement sizes must be positive")
    n = array_mb * (1 << 20) // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch pages before timing
    copy_s = _best_time(lambda: np.copyto(dst, src), repeats)
    bandwidth = 2 * src.nbytes / copy_s

    a = np.random.default_rng(0).standard_normal((matmul_n, matmul_n), dtype=np.float32)
    b = a.T.copy()
    a @ b
    mm_s = _best_time(lambda: a @ b, repeats)
    flops = {"fp32": 2 * matmul_n ** 3 / mm_s}
    try:
        import torch
    except ImportError:  # bf16 stays absent: only numpy was available
        torch = None
    if torch is not None:
        ta = torch.from_numpy(a).to(torch.bfloat16)
        tb = torch.from_numpy(b).to(torch.bfloat16)
        ta @ tb
        flops["bf16"] = 2 * matmul_n ** 3 / _best_time(lambda: ta @ tb, repeats)
    mem = psutil.virtual_memory().total
    how = f"measured now: np.copyto of {array_mb} MB, {matmul_n}^3 matmul, best of {repeats}"
    return HardwareSpec(
        name="cpu-local", description="this machine's CPU and RAM, measured on the spot",
        hbm_bytes=float(mem), hbm_bw=bandwidth, peak_flops=flops,
        interconnect_bw=None, interconnect_name="none (single host)",
        sources={"hbm_bytes": "psutil.virtual_memory().total", "hbm_bw": how, "peak_flops": how},
        notes=("measured on a shared machine: a floor for this CPU, not a datasheet peak",),
        measured=True,
    )


def get_hardware(name: str) -> HardwareSpec:
    """Preset by name, or ``cpu-local`` measured now. Unknown names raise :class:`PlanError`."""
    key = name.strip().lower()
    if key == "cpu-local":
        return measure_cpu_local()
    if key not in PRESETS:
        raise PlanError(f"unknown hardware {name!r}; presets: {', '.join(HARDWARE_NAMES)}")
    return PRESETS[key]


def torus_average_hops(shape: tuple[int, ...]) -> float:
    """Mean hop count to a uniformly random destination (self included) on a wrap-around torus.

    Per ring of size n the mean distance is mean(min(d, n - d) for d in 0..n-1); dimensions add.
    A 2x2x4 torus gives 0.5 + 0.5 + 1.0 = 2.0 hops (seed 003).
    """
    if not shape or any(n < 1 for n in shape):
        raise PlanError(f"torus shape must be positive integers, got {shape}")
    return sum(sum(min(d, n - d) for d in range(n)) / n for n in shape)


def parse_torus(text: str) -> tuple[int, ...]:
    """``"2x2x4"`` -> ``(2, 2, 4)``."""
    try:
        shape = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise PlanError(f"--torus wants dimensions like 2x2x4, got {text!r}") from None
    if not shape or any(n < 1 for n in shape):
        raise PlanError(f"--torus wants positive dimensions like 2x2x4, got {text!r}")
    return shape


__all__ = ["HardwareSpec", "PlanError", "PRESETS", "HARDWARE_NAMES", "PRECISIONS", "get_hardware",
           "measure_cpu_local", "torus_average_hops", "parse_torus"]
