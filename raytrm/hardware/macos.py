"""Mac hardware facts from `sysctl` and `system_profiler SPHardwareDataType` text.

The parsers are pure functions over command output, so they are tested on Linux against outputs recorded on
real Macs (tests/fixtures/macos); only `read_mac_facts` runs commands.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

COMMANDS = (["sysctl", "hw", "machdep.cpu"], ["sysctl", "hw.model"], ["system_profiler", "SPHardwareDataType"])
# system_profiler takes a second or two; a hung command must not hang `raytrm probe`.
COMMAND_TIMEOUT_S = 20.0
_UNIT_BYTES = {"MB": 2**20, "MIB": 2**20, "GB": 2**30, "GIB": 2**30, "TB": 2**40, "TIB": 2**40}
_TIERS = {"": "", "pro": "Pro", "max": "Max", "ultra": "Ultra", "pro or max": "Pro or Max"}
_TIER_UNKNOWN = "(tier unknown)"

# hw.cpufamily -> (CPUFAMILY_ARM_* codename, generation, tier); tier None where a family spans several tiers.
# Values: XNU's osfmk/mach/machine.h. Codename -> chip: LLVM's getHostCPUName (TargetParser/Host.cpp), checked
# against the recorded outputs in tests/fixtures/macos (M1, M2, M3 Max in sysctl_hw_*, M4 Max and M5 Pro in
# system_profiler_*).
_CPUFAMILY: dict[int, tuple[str, str, str | None]] = {
    0x1B588BB3: ("FIRESTORM_ICESTORM", "M1", None),  # also A14
    0xDA33D83D: ("BLIZZARD_AVALANCHE", "M2", None),  # also A15
    0xFA33415E: ("IBIZA", "M3", ""),
    0x5F4DEA93: ("LOBOS", "M3", "Pro"),
    0x72015832: ("PALMA", "M3", "Max"),
    0x6F5129AC: ("DONAN", "M4", ""),
    0x17D5B93A: ("BRAVA", "M4", None),  # M4 Pro and M4 Max
    0x1D5A87E8: ("HIDRA", "M5", ""),
    0xF76C5B1A: ("SOTRA", "M5", None),  # M5 Pro and M5 Max
}
# Core layouts (fastest kind first) that tell the tier where the family does not: Apple's published configurations,
# as recorded Macs report them (tests/fixtures/macos). Layouts that two tiers share stay "Pro or Max".
_TIER_BY_LAYOUT: dict[tuple[str, tuple[int, ...]], str] = {
    ("M1", (4, 4)): "", ("M1", (6, 2)): "Pro", ("M1", (8, 2)): "Pro or Max", ("M1", (16, 4)): "Ultra",
    ("M2", (4, 4)): "", ("M2", (6, 4)): "Pro", ("M2", (8, 4)): "Pro or Max", ("M2", (16, 8)): "Ultra",
    ("M3", (20, 8)): "Ultra", ("M3", (24, 8)): "Ultra",
    ("M4", (8, 4)): "Pro", ("M4", (10, 4)): "Pro or Max", ("M4", (12, 4)): "Max",
    ("M5", (5, 10)): "Pro", ("M5", (6, 12)): "Pro or Max",
}  # fmt: skip

_SYSCTL_LINE = re.compile(r"^([A-Za-z_][\w-]*(?:\.[\w-]+)+)\s*(?::|=)\s?(.*)$")
# Keys are words: this rejects prompts and `YYYY-MM-DD hh:mm:ss.fff system_profiler[pid:tid] ...` stderr lines.
_PROFILER_KEY = re.compile(r"[A-Za-z][A-Za-z0-9 ()/-]*")
_BULLET = re.compile(r"^[-*]\s+")
_PERFLEVEL_KEY = re.compile(r"^hw\.perflevel(\d+)\.(\w+)$")
_CPUFAMILY_LOG = re.compile(r"hw\.cpufamily:\s*(0x[0-9A-Fa-f]+|-?\d+)")
_CHIP = re.compile(r"\bApple\s+(M\d+)\b(.*)$", re.IGNORECASE)


@dataclass(frozen=True)
class CoreKind:
    """One kind of CPU core and how many physical cores of it the machine has."""

    name: str
    count: int


@dataclass
class MacFacts:
    """What a Mac's sysctl and system_profiler say; empty strings and zeros where they say nothing."""

    chip: str = ""
    model_name: str = ""
    model_id: str = ""
    memory_bytes: int = 0
    core_kinds: list[CoreKind] = field(default_factory=list)
    performance_cores: int = 0
    efficiency_cores: int = 0
    logical_cpus: int = 0
    notes: list[str] = field(default_factory=list)


def _int(value: str | None) -> int | None:
    try:
        return int(value.strip(), 0) if value is not None else None
    except ValueError:
        return None


def parse_sysctl(text: str) -> dict[str, str]:
    """`key: value` and `key = value` lines; prompts, bare `-n` values and stderr lines are skipped."""
    values: dict[str, str] = {}
    for line in (text or "").splitlines():
        match = _SYSCTL_LINE.match(line.strip())
        if match:
            values.setdefault(match.group(1), match.group(2).strip())
    return values


def parse_system_profiler(text: str) -> dict[str, str]:
    """`Key: value` lines of SPHardwareDataType; keys lower-cased, single-spaced ("total number of cores")."""
    values: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, colon, value = _BULLET.sub("", line.strip()).partition(":")
        if colon and value.strip() and _PROFILER_KEY.fullmatch(key.strip()):
            values.setdefault(" ".join(key.lower().split()), value.strip())
    return values


def chip_family(chip: str) -> tuple[str, str]:
    """("M2", "Pro") from "Apple M2 Pro"; ("", "") for a chip that is not Apple M-series.

    The tier is "", "Pro", "Max" or "Ultra"; for a chip inferred from hw.cpufamily it may be "Pro or Max", or
    "unknown", where the data cannot tell.
    """
    match = _CHIP.search(chip or "")
    if not match:
        return "", ""
    rest = " ".join(match.group(2).split()).lower()
    return match.group(1).upper(), _TIERS.get(rest, "unknown")


def _profiler_kinds(cores: str) -> list[CoreKind]:
    # "10 (8 performance and 2 efficiency)", "16 (12 Performance and 4 Efficiency)",
    # "15 (5 Super and 10 Performance)"; Intel Macs print only "4"
    inner = cores.partition("(")[2]
    return [CoreKind(name.capitalize(), int(n)) for n, name in re.findall(r"(\d{1,6})\s+([A-Za-z]+)", inner)]


def _sysctl_kinds(
    sysctl: dict[str, str], profiler: list[CoreKind], m5_or_later: bool, notes: list[str]
) -> list[CoreKind]:
    levels: dict[int, dict[str, str]] = {}
    for key, value in sysctl.items():
        match = _PERFLEVEL_KEY.match(key)
        if match:
            levels.setdefault(int(match.group(1)), {})[match.group(2)] = value
    for index in range(min(_int(sysctl.get("hw.nperflevels")) or 0, 8)):  # a garbled count must not loop long
        levels.setdefault(index, {})
    if not levels:
        return []
    aligned = len(profiler) == len(levels)
    if not aligned and any("physicalcpu" not in level for level in levels.values()):
        # `sysctl -a | grep cachesize` and similar excerpts carry perflevel keys but no core counts.
        notes.append("hw.perflevelN keys without core counts: perflevels ignored")
        return []
    kinds = []
    for position, index in enumerate(sorted(levels)):
        level = levels[index]
        name, count = level.get("name", "").strip(), _int(level.get("physicalcpu"))
        if aligned and not name:
            name = profiler[position].name
            notes.append(f"perflevel{index} named {name} by system_profiler (no hw.perflevel{index}.name)")
        elif not name and len(levels) == 2 and not m5_or_later:
            # macOS releases without name keys predate M5, and M1-M4 order their two levels P then E.
            name = ("Performance", "Efficiency")[position]
            notes.append(f"perflevel{index} assumed {name} (no hw.perflevel{index}.name; true for M1-M4)")
        elif not name:
            name = f"level{index}"
        if count is None and aligned:
            count = profiler[position].count
            notes.append(f"perflevel{index} core count from system_profiler (no hw.perflevel{index}.physicalcpu)")
        elif aligned and count != profiler[position].count:
            notes.append(f"perflevel{index}: sysctl {count} cores, system_profiler {profiler[position].count}")
        kinds.append(CoreKind(name, count or 0))
    return kinds


def _family_chip(family: int, kinds: list[CoreKind], notes: list[str]) -> str:
    codename, generation, tier = _CPUFAMILY[family]
    layout = tuple(kind.count for kind in kinds)
    how = f"chip inferred from hw.cpufamily 0x{family:08x} (CPUFAMILY_ARM_{codename})"
    by_layout = _TIER_BY_LAYOUT.get((generation, layout))
    if by_layout is not None and by_layout != tier:
        tier = by_layout
        how += f" and the core layout {'+'.join(map(str, layout))}"
    if tier is None:
        notes.append(f"{how}; the core layout {'+'.join(map(str, layout)) or '?'} does not tell the tier")
        return f"Apple {generation} {_TIER_UNKNOWN}"
    notes.append(how + ("; Pro and Max share that layout" if tier == "Pro or Max" else ""))
    return " ".join(("Apple", generation, tier)).strip()


def mac_facts(sysctl_text: str, profiler_text: str = "") -> MacFacts:
    """Combine `sysctl` and `system_profiler SPHardwareDataType` output; either may be empty."""
    sysctl, profiler = parse_sysctl(sysctl_text), parse_system_profiler(profiler_text)
    facts = MacFacts(model_name=profiler.get("model name", ""))
    notes = facts.notes
    if not sysctl and not profiler:
        notes.append("no sysctl or system_profiler output to read")
        return facts
    facts.model_id = sysctl.get("hw.model") or profiler.get("model identifier", "")

    family = _int(sysctl.get("hw.cpufamily"))
    if family is None:  # macOS 26 system_profiler logs the family to stderr
        logged = _CPUFAMILY_LOG.search(profiler_text or "")
        family = _int(logged.group(1)) if logged else None
    family = family & 0xFFFFFFFF if family is not None else None  # sysctl prints it signed (M2: -634136515)
    brand = sysctl.get("machdep.cpu.brand_string", "")
    chip = profiler.get("chip") or profiler.get("processor name", "")
    if brand and brand != "Apple processor":
        if chip and chip.lower() != brand.lower():
            notes.append(f"brand string {brand!r} differs from system_profiler chip {chip!r}")
        chip = brand
    elif brand:
        notes.append("generic brand string 'Apple processor' (early macOS 11)")
    if brand.startswith("Apple") and "machdep.cpu.features" in sysctl:
        notes.append("sysctl reports x86 cpu features: it ran under Rosetta")

    generation = chip_family(chip)[0] or _CPUFAMILY.get(family, ("", "", None))[1]
    m5_or_later = generation[1:].isdigit() and int(generation[1:]) >= 5
    cores = profiler.get("total number of cores", "")
    profiler_kinds = _profiler_kinds(cores)
    kinds = _sysctl_kinds(sysctl, profiler_kinds, m5_or_later, notes) or profiler_kinds
    physical = _int(sysctl.get("hw.physicalcpu")) or _int(sysctl.get("machdep.cpu.core_count"))
    physical = physical or _int(cores.partition(" ")[0])
    apple = bool(generation) or brand.startswith("Apple")
    if not kinds and physical:
        kinds = [CoreKind("level0" if apple else "Performance", physical)]
        if apple:
            notes.append("no perflevel keys: the split into performance and efficiency cores is unknown")
    facts.core_kinds = kinds
    facts.efficiency_cores = sum(k.count for k in kinds if k.name.lower() == "efficiency")
    facts.performance_cores = sum(k.count for k in kinds) - facts.efficiency_cores

    if not chip and family in _CPUFAMILY:
        chip = _family_chip(family, kinds, notes)
    elif not chip:
        notes.append("chip unknown" + (f" (hw.cpufamily 0x{family:08x} not in the table)" if family else ""))
    facts.chip = chip

    logical = 0
    for key in ("hw.logicalcpu", "hw.ncpu", "machdep.cpu.thread_count"):
        logical = logical or _int(sysctl.get(key)) or 0
    if not logical and apple and kinds:
        logical = sum(k.count for k in kinds)  # Apple Silicon has one thread per core
        notes.append("logical CPUs taken as the core count (Apple Silicon has no SMT)")
    facts.logical_cpus = logical

    memsize = _int(sysctl.get("hw.memsize"))
    memory = re.match(r"\s*(\d{1,6}(?:\.\d{1,3})?)\s*([KMGT]i?B)\b", profiler.get("memory", ""), re.IGNORECASE)
    if memsize:
        facts.memory_bytes = memsize
    elif memory and memory.group(2).upper() in _UNIT_BYTES:
        # Apple's "16 GB" is 16 GiB: hw.memsize on the same machines is 17179869184.
        facts.memory_bytes = int(float(memory.group(1)) * _UNIT_BYTES[memory.group(2).upper()])
        notes.append(f"memory from system_profiler {profiler['memory']!r}, read as binary units")
    else:
        notes.append("memory size unknown (no hw.memsize, no system_profiler Memory)")
    for note in notes:
        logger.debug("mac facts: %s", note)
    return facts


def _run_command(argv: list[str]) -> str:
    """Run one command; its stdout and stderr as text, or "" when it cannot run."""
    exe = shutil.which(argv[0]) or str(Path("/usr/sbin") / argv[0])  # /usr/sbin is not always on PATH
    argv = [exe, *argv[1:]]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        logger.debug("%s failed: %s", " ".join(argv), exc)
        return ""
    return (done.stdout or "") + (done.stderr or "")  # the parsers skip stderr lines; order does not matter


def read_mac_facts(run: Callable[[list[str]], str] | None = None) -> MacFacts:
    """Run sysctl and system_profiler through `run` (default: subprocess) and combine them; never raises."""
    run = run or _run_command
    outputs = []
    for argv in COMMANDS:
        try:
            out = run(list(argv))
        except Exception as exc:  # a probe must report what it could read, whatever an injected runner does
            logger.warning("%s failed: %s", " ".join(argv), exc)
            out = ""
        outputs.append(out if isinstance(out, str) else "")
    try:
        return mac_facts("\n".join(outputs[:2]), outputs[2])
    except Exception as exc:  # the parsers are meant to be total; a probe still must not die on a new format
        logger.exception("could not read the Mac's sysctl and system_profiler output")
        return MacFacts(notes=[f"sysctl / system_profiler output not understood: {exc}"])
