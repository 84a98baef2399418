"""What the fuzz tests share: garbage values, mutations of a parsed document, corrupted bytes, and the checks that
every refusal must pass (a UserError of one line; through the CLI, exit code 2 and one line on stderr).

Every property runs FUZZ_EXAMPLES examples (500; RAYTRM_FUZZ_EXAMPLES overrides it for a quick local run) from a
fixed seed (derandomize), so CI sees the same cases every time.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
from collections.abc import Sequence
from typing import Any

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from raytrm.cli import main
from raytrm.errors import UserError

FUZZ_EXAMPLES = int(os.environ.get("RAYTRM_FUZZ_EXAMPLES", "500"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
#: A refusal is one line a person reads; a longer one buries what is wrong.
MAX_ERROR_CHARS = 1500
#: `raytrm train` flags of a model small enough that one CLI run per example stays cheap.
TINY = ["--hidden-size", "16", "--L-layers", "1", "--H-cycles", "1", "--L-cycles", "1", "--global-batch", "4"]
TINY += ["--threads", "1", "--quiet"]

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2, 7, 2**31, 2**63, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e308, -1e308, 0.5]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    NUMBERS,
    st.text(max_size=12),
    st.sampled_from(["", "~", "null", "yes", "1e3", "0x10", "auto", "trm", "mlp_t", "sudoku", "1.0e-4", "-1"]),
)
#: Nested garbage of the types YAML and JSON carry.
GARBAGE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4),
    max_leaves=10,
)
#: Text drawn mostly from YAML's syntax characters, so the parser meets odd but plausible documents.
YAMLISH = st.text(alphabet=st.sampled_from(list("abc:- _[]{},&*!|>'\"#%@`?\n\t0129.eE+\\")), max_size=80)


def _slots(doc: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every value below the root, depth first."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in list(items):
        out.append((doc, key))
        out.extend(_slots(value))
    return out


def _nudged(value: Any) -> st.SearchStrategy:
    """Values of a wrong type or out of range in place of `value`."""
    wrong = [str(value), [value], {"value": value}, None, True]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        wrong += [0, -1, -value, value * 10**6, 2**63, float("nan"), float("inf"), -float("inf"), float(value) + 0.5]
    return st.sampled_from(wrong) | GARBAGE


@st.composite
def mutated(draw: st.DrawFn, doc: Any, extra: st.SearchStrategy | None = None) -> Any:
    """doc after one to three random edits: a value replaced by garbage or a wrong type, a key deleted, renamed or
    added, a section turned into a scalar; `extra` adds values of the surface's own kinds (tensors, arrays)."""
    doc = copy.deepcopy(doc)
    garbage = GARBAGE if extra is None else GARBAGE | extra
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(doc)
        if not slots or draw(st.integers(0, 19)) == 0:
            return draw(garbage)  # the whole document is something else
        parent, key = slots[draw(st.integers(0, len(slots) - 1))]
        op = draw(st.sampled_from(["replace", "nudge", "nudge", "delete", "add", "rename"]))
        value = parent[key]
        if op == "replace":
            parent[key] = draw(garbage)
        elif op == "nudge":
            parent[key] = draw(_nudged(value))
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(value, dict):
            value[draw(st.text(max_size=10) | st.integers())] = draw(garbage)
        elif op == "add" and isinstance(value, list):
            value.append(draw(garbage))
        elif op == "rename" and isinstance(parent, dict):
            new = draw(st.sampled_from([str(key).upper(), str(key)[:-1], f"{key}_", f"{key}s"]) | st.text(max_size=8))
            parent[new] = parent.pop(key)
        else:
            parent[key] = draw(garbage)
    return doc


@st.composite
def corrupted(draw: st.DrawFn, data: bytes) -> bytes:
    """data truncated, bit-flipped, with bytes inserted (often not UTF-8), or replaced by random bytes."""
    op = draw(st.sampled_from(["truncate", "flip", "insert", "random", "latin1"]))
    if op == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if op == "flip" and data:
        at = draw(st.integers(0, len(data) - 1))
        return data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1 :]
    if op == "insert":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    if op == "latin1":
        return data.decode("utf-8", "replace").encode("latin-1", "replace") + "é\n".encode("latin-1")
    return draw(st.binary(max_size=200))


def yaml_bytes(doc: Any) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode()


def yaml_files(seed: dict) -> st.SearchStrategy[bytes]:
    """File contents for a YAML surface: mostly mutations of a valid document, then garbage and corrupt bytes."""
    edits = mutated(seed).map(yaml_bytes)
    return st.one_of(
        edits,
        edits,
        edits,
        edits.flatmap(corrupted),
        GARBAGE.map(yaml_bytes),
        YAMLISH.map(str.encode),
        st.binary(max_size=200),
    )


def check_refusal(error: BaseException) -> str:
    """A refusal is a UserError whose message is one line, not empty and not endless."""
    assert isinstance(error, UserError), f"{type(error).__name__} escaped: {error}"
    message = str(error)
    assert message and len(message.splitlines()) == 1 and "\n" not in message, repr(message)
    assert len(message) <= MAX_ERROR_CHARS, f"{len(message)} characters: {message[:300]}..."
    return message


def load_or_refusal(load: Any, *args: Any) -> tuple[Any, str | None]:
    """(the loaded object, None) or (None, the one-line message); any other exception fails the property."""
    try:
        return load(*args), None
    except UserError as e:
        return None, check_refusal(e)


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """`raytrm ARGV` in this process: (exit code, stdout, stderr); an exception escaping main fails the property."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def check_cli_refusal(code: int, err: str) -> str:
    """Exit code 2 and exactly one line on stderr, `raytrm: error: ...`, never a traceback."""
    lines = err.strip().splitlines()
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("raytrm: error: "), err[-2000:]
    assert "Traceback" not in err
    assert len(lines[0]) <= MAX_ERROR_CHARS + len("raytrm: error: "), lines[0][:300]
    return lines[0]


class Counter:
    """Counts the examples a property ran and how many were refused, for the record (printed with -s)."""

    def __init__(self, surface: str) -> None:
        self.surface, self.ran, self.refused = surface, 0, 0

    def add(self, refused: bool) -> None:
        self.ran += 1
        self.refused += bool(refused)

    def report(self) -> str:
        return f"fuzz {self.surface}: {self.ran} examples, {self.refused} refused, {self.ran - self.refused} loaded"
