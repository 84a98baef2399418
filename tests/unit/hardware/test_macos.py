"""macOS hardware readers against outputs recorded on real Macs (tests/fixtures/macos; its README cites each)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from raytrm.hardware import macos
from raytrm.hardware.macos import (
    CoreKind,
    MacFacts,
    chip_family,
    mac_facts,
    parse_sysctl,
    parse_system_profiler,
    read_mac_facts,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "macos"
P, E = "Performance", "Efficiency"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8") if name else ""


def fake_runner(sysctl_hw: str = "", sysctl_model: str = "", profiler: str = "", calls: list | None = None):
    """A `run` that answers the three commands read_mac_facts issues with recorded text."""
    outputs = {
        ("sysctl", "hw", "machdep.cpu"): sysctl_hw,
        ("sysctl", "hw.model"): sysctl_model,
        ("system_profiler", "SPHardwareDataType"): profiler,
    }

    def run(argv: list[str]) -> str:
        if calls is not None:
            calls.append(list(argv))
        return outputs[tuple(argv)]

    return run


# id, sysctl fixture, system_profiler fixture, chip, model name, model id, memory bytes, core kinds, logical CPUs
MACHINES = [
    ("m1-air-16gb", "sysctl_hw_m1_air_16gb.txt", "system_profiler_m1_air_16gb.txt",
     "Apple M1", "MacBook Air", "MacBookAir10,1", 17179869184, [(P, 4), (E, 4)], 8),
    ("m1-air-8gb", "", "system_profiler_m1_air_8gb.txt",
     "Apple M1", "MacBook Air", "MacBookAir10,1", 8589934592, [(P, 4), (E, 4)], 8),
    ("m2-air-24gb", "sysctl_hw_m2_air_24gb.txt", "",
     "Apple M2", "", "", 25769803776, [(P, 4), (E, 4)], 8),
    ("m1-pro-mbp-16gb", "sysctl_a_perflevel_m1_pro.txt", "system_profiler_m1_pro_mbp_16gb.txt",
     "Apple M1 Pro", "MacBook Pro", "MacBookPro18,1", 17179869184, [(P, 8), (E, 2)], 10),
    ("m2-pro-mbp-16gb", "", "system_profiler_m2_pro_mbp_16gb.txt",
     "Apple M2 Pro", "MacBook Pro", "Mac14,10", 17179869184, [(P, 8), (E, 4)], 12),
    ("m1-max-mbp-32gb", "", "system_profiler_m1_max_mbp_32gb.txt",
     "Apple M1 Max", "MacBook Pro", "MacBookPro18,2", 34359738368, [(P, 8), (E, 2)], 10),
    ("m3-max-128gb", "sysctl_hw_m3_max_128gb.txt", "",
     "Apple M3 Max", "", "", 137438953472, [(P, 12), (E, 4)], 16),
    ("m4-pro-mbp-24gb", "", "system_profiler_m4_pro_mbp_24gb.txt",
     "Apple M4 Pro", "MacBook Pro", "Mac16,8", 25769803776, [(P, 8), (E, 4)], 12),
    ("m4-max-studio-128gb", "", "system_profiler_m4_max_studio_128gb.txt",
     "Apple M4 Max", "Mac Studio", "Mac16,9", 137438953472, [(P, 12), (E, 4)], 16),
    ("m2-ultra-studio-192gb", "", "system_profiler_m2_ultra_studio_192gb.txt",
     "Apple M2 Ultra", "Mac Studio", "", 206158430208, [(P, 16), (E, 8)], 24),
    ("m5-pro-mbp-24gb", "sysctl_perflevel_names_m5_pro.txt", "system_profiler_m5_pro_mbp_24gb.txt",
     "Apple M5 Pro", "MacBook Pro", "Mac17,9", 25769803776, [("Super", 5), (P, 10)], 15),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sysctl_file", "profiler_file", "chip", "model_name", "model_id", "memory", "kinds", "logical"),
    [m[1:] for m in MACHINES],
    ids=[m[0] for m in MACHINES],
)
def test_recorded_machines(sysctl_file, profiler_file, chip, model_name, model_id, memory, kinds, logical):
    calls: list = []
    run = fake_runner(sysctl_hw=fixture(sysctl_file), profiler=fixture(profiler_file), calls=calls)
    facts = read_mac_facts(run)
    assert calls == [list(argv) for argv in macos.COMMANDS]
    assert facts.chip == chip
    assert (facts.model_name, facts.model_id) == (model_name, model_id)
    assert facts.memory_bytes == memory
    assert facts.core_kinds == [CoreKind(name, count) for name, count in kinds]
    assert facts.efficiency_cores == sum(count for name, count in kinds if name == E)
    assert facts.performance_cores == sum(count for name, count in kinds if name != E)
    assert facts.logical_cpus == logical


def test_m5_pro_super_cores_are_not_efficiency_cores():
    facts = mac_facts(fixture("sysctl_perflevel_names_m5_pro.txt"), fixture("system_profiler_m5_pro_mbp_24gb.txt"))
    assert facts.core_kinds == [CoreKind("Super", 5), CoreKind("Performance", 10)]
    assert (facts.performance_cores, facts.efficiency_cores) == (15, 0)
    assert chip_family(facts.chip) == ("M5", "Pro")
    assert any("CPUFAMILY_ARM_SOTRA" in note for note in facts.notes)


def test_m3_max_from_cpufamily_alone():
    facts = mac_facts(fixture("sysctl_hw_m3_max_128gb.txt"))
    assert facts.chip == "Apple M3 Max"
    assert any("0x72015832" in note and "PALMA" in note for note in facts.notes)


def test_signed_cpufamily_of_m2():
    facts = mac_facts(fixture("sysctl_hw_m2_air_24gb.txt"))
    assert parse_sysctl(fixture("sysctl_hw_m2_air_24gb.txt"))["hw.cpufamily"] == "-634136515"
    assert facts.chip == "Apple M2"
    assert any("0xda33d83d" in note for note in facts.notes)


def test_perflevel1_printed_first():
    # §1.2 and §1.3 print perflevel1 before perflevel0: the kinds still come fastest first.
    assert mac_facts(fixture("sysctl_hw_m3_max_128gb.txt")).core_kinds == [CoreKind(P, 12), CoreKind(E, 4)]
    assert mac_facts(fixture("sysctl_a_perflevel_m1_pro.txt")).core_kinds == [CoreKind(P, 8), CoreKind(E, 2)]


def test_line_order_does_not_matter():
    text = fixture("sysctl_hw_m1_air_16gb.txt")
    forward, backward = mac_facts(text), mac_facts("\n".join(reversed(text.splitlines())))
    assert backward.core_kinds == forward.core_kinds == [CoreKind(P, 4), CoreKind(E, 4)]
    assert (backward.chip, backward.memory_bytes, backward.logical_cpus) == ("Apple M1", 17179869184, 8)


def test_missing_name_keys_assume_performance_then_efficiency():
    facts = mac_facts(fixture("sysctl_hw_m2_air_24gb.txt"))
    assert facts.core_kinds == [CoreKind(P, 4), CoreKind(E, 4)]
    assert any("perflevel1 assumed Efficiency" in note for note in facts.notes)


def test_missing_name_keys_take_names_from_system_profiler():
    facts = mac_facts(fixture("sysctl_a_perflevel_m1_pro.txt"), fixture("system_profiler_m1_pro_mbp_16gb.txt"))
    assert facts.core_kinds == [CoreKind(P, 8), CoreKind(E, 2)]
    assert any("named Efficiency by system_profiler" in note for note in facts.notes)


def test_m5_family_without_name_keys_is_not_guessed():
    # Synthetic: M5 Pro counts (§1.8) and the SOTRA family (§4.6 stderr) with the name keys left out.
    lines = ["hw.nperflevels: 2", "hw.perflevel0.physicalcpu: 5", "hw.perflevel1.physicalcpu: 10"]
    facts = mac_facts("\n".join([*lines, f"hw.cpufamily: {0xF76C5B1A - 2**32}"]))
    assert facts.core_kinds == [CoreKind("level0", 5), CoreKind("level1", 10)]
    assert (facts.performance_cores, facts.efficiency_cores) == (15, 0)
    assert facts.chip == "Apple M5 Pro"


def test_sysctl_n_transcript_has_no_keys():
    text = fixture("sysctl_n_m3_pro_36gb.txt")
    parsed = parse_sysctl(text)
    # Only the `sysctl -a | grep cachesize` lines carry keys; bare -n values and `unknown oid` stderr do not.
    assert len(parsed) == 10
    assert all("cachesize" in key for key in parsed)
    assert "hw.memsize" not in parsed and not any(key.startswith("sysctl") for key in parsed)
    facts = mac_facts(text)
    assert (facts.chip, facts.memory_bytes, facts.core_kinds, facts.logical_cpus) == ("", 0, [], 0)
    assert any("without core counts" in note for note in facts.notes)


def test_parse_sysctl_full_dump():
    parsed = parse_sysctl(fixture("sysctl_hw_m1_air_16gb.txt"))
    assert len(parsed) == 47  # 49 lines less the `% sysctl hw` prompt and the `[...]` marker
    assert parsed["hw.memsize"] == "17179869184"
    assert parsed["hw.perflevel1.physicalcpu"] == "4"
    assert parsed["hw.osenvironment"] == ""
    assert parsed["hw.cachesize"] == "3499458560 65536 4194304 0 0 0 0 0 0 0"


def test_parse_sysctl_equals_form_and_model():
    # `hw.model: MacBookPro18,3` as quoted in macos-outputs.md §1.7 (unattributed).
    assert mac_facts("$ sysctl hw.model\nhw.model: MacBookPro18,3\n").model_id == "MacBookPro18,3"
    assert parse_sysctl("kern.memorystatus_vm_pressure_level = 1") == {"kern.memorystatus_vm_pressure_level": "1"}


def test_brand_strings():
    assert mac_facts(fixture("sysctl_machdep_m1_big_sur.txt")).chip == "Apple M1"
    early = mac_facts(fixture("sysctl_machdep_m1_early_big_sur.txt"))
    assert early.chip == ""
    assert early.core_kinds == [CoreKind("level0", 8)] and early.logical_cpus == 8
    assert any("Apple processor" in note for note in early.notes)
    rosetta = mac_facts(fixture("sysctl_machdep_m1_rosetta.txt"))
    assert rosetta.chip == "Apple M1"
    assert any("Rosetta" in note for note in rosetta.notes)


def test_intel_brand_string():
    brand = fixture("sysctl_n_brand_intel_i7_3820qm.txt").splitlines()[1]
    assert brand == "Intel(R) Core(TM) i7-3820QM CPU @ 2.70GHz"
    # The recorded `-n` form has no key; this is the line `sysctl machdep.cpu` prints for that value.
    facts = mac_facts(f"machdep.cpu.brand_string: {brand}\nhw.physicalcpu: 4\nhw.logicalcpu: 8\n")
    assert facts.chip == brand
    assert chip_family(facts.chip) == ("", "")
    assert facts.core_kinds == [CoreKind(P, 4)]
    assert (facts.performance_cores, facts.efficiency_cores, facts.logical_cpus) == (4, 0, 8)


@pytest.mark.parametrize(
    ("chip", "expected"),
    [
        ("Apple M2 Pro", ("M2", "Pro")),
        ("Apple M1", ("M1", "")),
        ("Apple M2 Ultra", ("M2", "Ultra")),
        ("Apple M1 Max", ("M1", "Max")),
        ("Apple M3 Pro", ("M3", "Pro")),
        ("apple m4 max", ("M4", "Max")),
        ("Apple M4 Pro or Max", ("M4", "Pro or Max")),
        ("Apple M1 (tier unknown)", ("M1", "unknown")),
        ("Apple processor", ("", "")),
        ("Intel(R) Core(TM) i9-9980HK CPU @ 2.40GHz", ("", "")),
        ("", ("", "")),
    ],
)
def test_chip_family(chip, expected):
    assert chip_family(chip) == expected


def test_parse_system_profiler_capitalised_with_stderr_noise():
    parsed = parse_system_profiler(fixture("system_profiler_m4_max_studio_128gb.txt"))
    assert parsed == {
        "system version": "26.4",
        "model name": "Mac Studio",
        "model identifier": "Mac16,9",
        "total number of cores": "16 (12 Performance and 4 Efficiency)",
        "memory": "128 GB",
    }


def test_parse_system_profiler_layouts():
    aligned = parse_system_profiler(fixture("system_profiler_m1_air_8gb.txt"))
    assert aligned["model name"] == "MacBook Air" and aligned["activation lock status"] == "Disabled"
    bullets = parse_system_profiler(fixture("system_profiler_m4_pro_mbp_24gb.txt"))
    assert bullets["model number"] == "MX2H3LL/A" and bullets["chip"] == "Apple M4 Pro"
    mini = parse_system_profiler(fixture("system_profiler_m1_pro_mbp_16gb.txt"))
    assert mini["os loader version"] == "8422.141.2.700.1" and "hardware" not in mini
    redacted = parse_system_profiler(fixture("system_profiler_m1_max_mbp_32gb.txt"))
    assert redacted["serial number (system)"] == "REDACTED"


def test_cpufamily_from_system_profiler_stderr():
    facts = mac_facts("", fixture("system_profiler_m4_max_studio_128gb.txt"))
    assert facts.chip == "Apple M4 Max"
    assert any("CPUFAMILY_ARM_BRAVA" in note and "12+4" in note for note in facts.notes)


@pytest.mark.parametrize(
    ("memory", "expected"),
    [("16 GB", 17179869184), ("8 GiB", 8589934592), ("1 TB", 2**40), ("512 MB", 2**29), ("lots", 0)],
)
def test_profiler_memory_units(memory, expected):
    assert mac_facts("", f"Memory: {memory}\n").memory_bytes == expected


def test_memsize_preferred_over_profiler_memory():
    facts = mac_facts("hw.memsize: 17179869184\n", "      Memory: 8 GB\n")
    assert facts.memory_bytes == 17179869184


def test_empty_input():
    facts = mac_facts("", "")
    assert facts == MacFacts(notes=facts.notes)
    assert facts.notes and facts.memory_bytes == 0 and facts.core_kinds == []


@pytest.mark.parametrize(
    "text",
    [
        "\x00\xff garbage",
        ":::\n= =\n",
        "hw.nperflevels: 99999999999\n",
        "hw.perflevel0.physicalcpu: many\nhw.perflevel1.name: Efficiency\n",
        "hw.cpufamily: 0xzz\nhw.memsize: -\n",
    ],
)
def test_odd_sysctl_text_never_raises(text):
    assert isinstance(mac_facts(text, text), MacFacts)


@pytest.mark.parametrize("odd", ["Total Number of Cores: (x and y)", "Memory: 1.2.3 GB", "Chip:", "- : -"])
def test_odd_profiler_text_never_raises(odd):
    assert isinstance(mac_facts("", odd), MacFacts)


def test_read_mac_facts_with_failing_runner():
    def broken(argv: list[str]) -> str:
        raise OSError("no such command")

    facts = read_mac_facts(broken)
    assert facts.chip == "" and facts.memory_bytes == 0 and facts.notes
    assert read_mac_facts(lambda argv: None).memory_bytes == 0  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize(
    "error", [FileNotFoundError("sysctl"), subprocess.TimeoutExpired("system_profiler", macos.COMMAND_TIMEOUT_S)]
)
def test_default_runner_returns_empty_on_failure(monkeypatch, error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(macos.subprocess, "run", fail)
    assert macos._run_command(["system_profiler", "SPHardwareDataType"]) == ""
    assert read_mac_facts().notes == ["no sysctl or system_profiler output to read"]
