"""The tier table: it loads, rules match as documented, unmatched machines get a generic tier."""

from __future__ import annotations

import dataclasses

import pytest

from raytrm.errors import UserError
from raytrm.hardware.probe import HardwareInfo
from raytrm.hardware.tiers import generic_budget_mb, load_tiers, match_tier

GiB = 1024**3


def machine(**kw) -> HardwareInfo:
    base = dict(
        os="darwin",
        os_version="15.1",
        arch="arm64",
        model_name="MacBook Air",
        model_id="Mac14,2",
        chip="Apple M2",
        chip_family="M2",
        chip_variant="",
        performance_cores=4,
        efficiency_cores=4,
        core_kinds=[],
        logical_cpus=8,
        memory_bytes=16 * GiB,
        device="mps",
        device_reason="",
        bf16=False,
        accelerator_memory={},
        thermal_sources=[],
        memory_pressure_sources=[],
        versions={},
    )
    base.update(kw)
    return HardwareInfo(**base)


@pytest.fixture(scope="module")
def tiers():
    return load_tiers()


def test_table_budgets_leave_the_os_its_headroom(tiers):
    by_name = {t.name: t for t in tiers}
    assert by_name["macbook-air-8gb"].memory_budget_mb == 5632  # 5.5 of 8 GB
    assert by_name["macbook-pro-16gb"].memory_budget_mb == 12288  # 12 of 16
    assert by_name["mac-desktop-32gb"].memory_budget_mb == 24576  # 24 of 32
    for t in tiers:
        lo, _ = t.match.memory_gb
        assert t.memory_budget_mb < lo * 1024, f"{t.name}: budget exceeds the smallest machine it matches"


@pytest.mark.parametrize(
    "kw, name, threads, cap",
    [
        (dict(model_name="MacBook Air", memory_bytes=8 * GiB), "macbook-air-8gb", 4, "fair"),
        (dict(model_name="MacBook Air", memory_bytes=24 * GiB), "macbook-air-24gb", 4, "fair"),
        (
            dict(model_name="MacBook Pro", chip="Apple M2 Pro", performance_cores=8, memory_bytes=16 * GiB),
            "macbook-pro-16gb",
            8,
            "fair",
        ),
        (
            dict(model_name="MacBook Pro", chip="Apple M3 Max", performance_cores=12, memory_bytes=128 * GiB),
            "macbook-pro-128gb",
            12,
            "fair",
        ),
        (
            dict(model_name="Mac Studio", chip="Apple M2 Ultra", performance_cores=16, memory_bytes=192 * GiB),
            "mac-desktop-192gb",
            16,
            "serious",
        ),
        (
            dict(model_name="Mac mini", chip="Apple M4", memory_bytes=16 * GiB),
            "mac-desktop-16gb",
            4,
            "serious",
        ),
    ],
)
def test_macs_match_their_tier(tiers, kw, name, threads, cap):
    tier = match_tier(machine(**kw), tiers)
    assert (tier.name, tier.threads, tier.thermal_cap, tier.generic) == (name, threads, cap, False)
    assert name in tier.reason


@pytest.mark.parametrize(
    "kw",
    [
        dict(chip="Intel(R) Core(TM) i9-9980HK CPU @ 2.40GHz", model_name="MacBook Pro", device="cpu"),
        dict(model_name=""),  # a Mac whose model could not be read
        dict(
            os="linux",
            model_name="",
            chip="AMD EPYC 7B13",
            device="cpu",
            memory_bytes=24 * GiB,
            performance_cores=2,
        ),
    ],
)
def test_unmatched_machines_get_a_generic_tier(tiers, kw):
    hw = machine(**kw)
    tier = match_tier(hw, tiers)
    assert tier.generic
    assert "no rule in tiers.yaml matches" in tier.reason
    assert tier.memory_budget_mb == generic_budget_mb(hw.memory_bytes)
    assert tier.threads == hw.performance_cores


def test_generic_budget_uses_the_same_headroom_curve():
    assert generic_budget_mb(8 * GiB) == 5632
    assert generic_budget_mb(16 * GiB) == 12288
    assert generic_budget_mb(32 * GiB) == 24576


BAD_TIERS = {
    "duplicate name": (
        "raytrm_tiers: 1\ntiers:\n  - {name: a, memory_budget_mb: 10}\n  - {name: a, memory_budget_mb: 10}\n",
        "tiers[1].name: got 'a', expected a name used once",
    ),
    "inverted memory range": (
        "raytrm_tiers: 1\ntiers:\n  - {name: a, memory_budget_mb: 10, match: {memory_gb: [16, 8]}}\n",
        "tiers[0].match.memory_gb: got [16, 8], expected [min, max) with min < max",
    ),
    "bad thermal cap": (
        "raytrm_tiers: 1\ntiers:\n  - {name: a, memory_budget_mb: 10, thermal_cap: hot}\n",
        "tiers[0].thermal_cap: got 'hot', expected one of nominal, fair, serious, critical",
    ),
    "unknown match key": (
        "raytrm_tiers: 1\ntiers:\n  - {name: a, memory_budget_mb: 10, match: {ram: 8}}\n",
        "tiers[0].match.ram: unknown field",
    ),
    "bad threads": (
        "raytrm_tiers: 1\ntiers:\n  - {name: a, memory_budget_mb: 10, defaults: {threads: all}}\n",
        "tiers[0].defaults.threads: got 'all', expected a number >= 1 or 'performance_cores'",
    ),
    "newer version": ("raytrm_tiers: 7\ntiers: []\n", "raytrm_tiers 7 is newer than this raytrm"),
    "version not a number": ("raytrm_tiers: one\ntiers: []\n", "raytrm_tiers: got 'one', expected a schema version"),
    "version 0": ("raytrm_tiers: 0\ntiers: []\n", "raytrm_tiers: got 0, expected a schema version, a whole number"),
}


@pytest.mark.parametrize("kind", sorted(BAD_TIERS))
def test_bad_tier_table(tmp_path, kind):
    text, piece = BAD_TIERS[kind]
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_tiers(path)
    assert piece in str(err.value)
    assert str(err.value).startswith(str(path))


def test_first_match_wins(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "raytrm_tiers: 1\ntiers:\n"
        "  - {name: small, memory_budget_mb: 100, match: {memory_gb: [0, 32]}}\n"
        "  - {name: any, memory_budget_mb: 200}\n"
    )
    tiers = load_tiers(path)
    assert match_tier(machine(memory_bytes=16 * GiB), tiers).name == "small"
    assert match_tier(machine(memory_bytes=64 * GiB), tiers).name == "any"
    assert dataclasses.asdict(match_tier(machine(), tiers))["memory_budget_mb"] == 100
