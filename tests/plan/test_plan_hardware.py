"""Hardware presets, their sources, the torus hop model and the on-the-spot CPU measurement."""
from __future__ import annotations

import math

import pytest

from tokenmill.plan.hardware import (HARDWARE_NAMES, PRESETS, HardwareSpec, PlanError, get_hardware,
                                     measure_cpu_local, parse_torus, torus_average_hops)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_number_has_a_source(name: str) -> None:
    hw = PRESETS[name]
    for key in ("hbm_bytes", "hbm_bw", "peak_flops", "interconnect_bw"):
        assert hw.sources.get(key), f"{name}: no source for {key}"
    assert "bf16" in hw.peak_flops and "fp8" in hw.peak_flops
    assert hw.peak_flops["fp8"] == pytest.approx(2 * hw.peak_flops["bf16"])


def test_known_public_figures() -> None:
    assert PRESETS["h100"].hbm_bytes == 80e9 and PRESETS["h100"].hbm_bw == 3.35e12
    assert PRESETS["h200"].hbm_bytes == 141e9 and PRESETS["h200"].hbm_bw == 4.8e12
    assert PRESETS["b200"].hbm_bytes == 180e9 and PRESETS["b300"].hbm_bytes == 288e9
    assert "fp4" in PRESETS["b200"].peak_flops and "fp4" not in PRESETS["h100"].peak_flops
    assert set(HARDWARE_NAMES) == {"b200", "b300", "h100", "h200", "tpu-v7x", "cpu-local"}


def test_missing_precision_and_unknown_preset_are_clear_errors() -> None:
    with pytest.raises(PlanError, match="no fp4 peak"):
        get_hardware("h100").flops("fp4")
    with pytest.raises(PlanError, match="unknown hardware 'a100'"):
        get_hardware("a100")
    with pytest.raises(PlanError, match="positive"):
        get_hardware("h100").with_overrides(hbm_bytes=-1)
    with pytest.raises(PlanError):
        HardwareSpec("x", "x", 1, 1, {"int3": 1.0}, None, "none", {})


def test_overrides_replace_numbers_and_sources() -> None:
    hw = get_hardware("b200").with_overrides(hbm_bytes=192e9, hbm_bw=7.7e12)
    assert hw.hbm_bytes == 192e9 and hw.hbm_bw == 7.7e12
    assert hw.sources["hbm_bytes"] == "given on the command line"
    assert PRESETS["b200"].hbm_bytes == 180e9  # the preset is untouched


def test_torus_hops() -> None:
    assert torus_average_hops((2, 2, 4)) == 2.0  # seed 003: 0.5 + 0.5 + 1.0
    assert torus_average_hops((8,)) == 2.0  # ring of 8: (0+1+2+3+4+3+2+1) / 8
    assert torus_average_hops((1,)) == 0.0
    assert parse_torus("2x2x4") == (2, 2, 4)
    for bad in ("2x0", "axb", ""):
        with pytest.raises(PlanError):
            parse_torus(bad)


def test_cpu_local_is_measured() -> None:
    hw = measure_cpu_local(array_mb=16, matmul_n=256, repeats=2)
    assert hw.measured and hw.name == "cpu-local"
    assert hw.hbm_bytes > 1e9 and math.isfinite(hw.hbm_bw) and hw.hbm_bw > 1e8
    assert hw.peak_flops["fp32"] > 1e8
    assert "measured" in hw.sources["hbm_bw"]
    assert hw.interconnect_bw is None
