"""The environment variables kvreplay reads, declared once (`VARIABLES`), and one reader per
grammar for the kernel switches among them, so that a mistyped value is a ValueError naming the
variable rather than a silent default:

- `switch`: on/off, 1 or unset on, 0 off (KVREPLAY_HUGE_PAGES, KVREPLAY_FUSED_DECODE, ...);
  `is_set` for the ones whose unset state is a default of its own (KVREPLAY_QUANT_PANELS).
- `flag`: on/off in words too, 1/true/yes/on or unset on, 0/false/no/off off (KVREPLAY_CPU_KERNELS).
- `choice`: one of a few values, each standing for a setting (KVREPLAY_INT_PRODUCTS).
- `integer`: a whole number within bounds (KVREPLAY_PANEL_ROWS).

The compiled kernels read two switches themselves (getenv: `KERNEL_SWITCHES`); they only know
whether the value is "0", so `check_kernel_switches` checks them before a kernel loads.
`markdown_rows` renders the table for docs/kernels.md. Triton's TRITON_INTERPRET and the three
variables outside the kernels (KVREPLAY_DEVICE, KVREPLAY_API_KEY, KVREPLAY_CACHE_DIR) are listed
for that table only; the modules named in their rows read them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Variable:
    """One environment variable: `values` is also how a refusal words what is accepted ("... must
    be {values}, got ..."), `grammar` the reader that takes it (or "text" for a free value read
    outside the kernels), `read_by` where it is read."""
    name: str
    values: str
    default: str
    what: str
    grammar: str
    read_by: str


VARIABLES = (
    Variable("KVREPLAY_CPU_KERNELS", "1 or 0 (or true/false, yes/no, on/off)", "1",
             "0 skips building and using the compiled CPU kernels (the PyTorch path runs instead)",
             "flag", "kernels/cpu_kernels.py"),
    Variable("KVREPLAY_QUANT_PANELS", "0 or 1", "the CPU decides: 1 with AVX512-BF16 (or an unknown CPU), else 0",
             "1 keeps GGUF Q4_0/Q4_1/Q8_0 weights as blocks in the panel copy, expanded to bf16 per use; "
             "0 bf16 panels", "switch", "layers/linear.py"),
    Variable("KVREPLAY_INT_PRODUCTS", "0, 1 (16-bit x), 16 or 8",
             "8 where the kernel is its AVX2 build and KVREPLAY_QUANT_PANELS is unset, else 0",
             "integer products on GGUF blocks, x at 8 bits (Q4 blocks) or 16 bits; 0 none",
             "choice", "layers/linear.py"),
    Variable("KVREPLAY_PANEL_ROWS", "an integer from 0 to 128", "the machine's (every count without oneDNN bf16 "
             "products; 128 on AVX512-BF16, 64 with AMX tiles)",
             "most rows of a bf16 projection that go to the panel kernel rather than oneDNN",
             "integer", "layers/linear.py"),
    Variable("KVREPLAY_HUGE_PAGES", "0 or 1", "1",
             "0 keeps large CPU buffers (KV pool, panel copies) on 4 KiB pages rather than 2 MiB ones",
             "switch", "kernels/huge_pages.py"),
    Variable("KVREPLAY_FUSED_DECODE", "0 or 1", "1",
             "0 runs CPU decode steps through the Python layer code rather than decode_layers",
             "switch", "models/llama.py"),
    Variable("KVREPLAY_CUDA_GRAPHS", "0 or 1", "1",
             "0 runs every GPU decode step eagerly rather than replaying CUDA graphs",
             "switch", "engine/cuda_graphs.py"),
    Variable("KVREPLAY_AMX_PANELS", "0 or 1", "1",
             "0 keeps the panel products off AMX tiles (read once per process, by the kernel)",
             "switch", "C++ (csrc/panel_avx512.cpp)"),
    Variable("KVREPLAY_AMX_ATTENTION", "0 or 1", "1",
             "0 keeps decode attention's scores off AMX tiles (read at each call, by the kernel)",
             "switch", "C++ (csrc/attention.h)"),
    Variable("TRITON_INTERPRET", "1, or anything else (Triton's own)", "compiled kernels (a GPU)",
             "1 runs the Triton kernels on CPU tensors through Triton's interpreter (must be set before "
             "triton is imported); attention_backend=triton on a CPU needs it", "text",
             "Triton; kernels/triton_backend.py"),
    Variable("KVREPLAY_DEVICE", "cpu or cuda[:N]", "cpu",
             "the device an engine runs on when none is named", "text", "config.py"),
    Variable("KVREPLAY_API_KEY", "any string", "none (no key)",
             "the key `kvreplay serve` asks clients for", "text", "commands/serve.py"),
    Variable("KVREPLAY_CACHE_DIR", "a directory", "~/.cache/kvreplay",
             "where tokenizers converted from GGUF files are cached", "text", "models/loader.py"),
)
DECLARED = {variable.name: variable for variable in VARIABLES}

# switches that the compiled kernels read themselves (getenv): checked here before a kernel
# loads, since the C++ side only knows whether the value is "0"
KERNEL_SWITCHES = tuple(v.name for v in VARIABLES if v.read_by.startswith("C++"))

_ON, _OFF = ("", "1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str) -> bool:
    """Whether switch `name` is on: 1 or unset yes, 0 no, anything else a ValueError."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value != "0"


def is_set(name: str) -> bool:
    """Whether `name` holds a value (not unset or blank): for switches whose unset state is a
    default of its own (KVREPLAY_QUANT_PANELS: the CPU decides)."""
    return os.environ.get(name, "").strip() != ""


def flag(name: str) -> bool:
    """Whether `name` is on, in words too: unset, 1, true, yes or on yes; 0, false, no or off no
    (any case); anything else a ValueError."""
    value = os.environ.get(name, "").strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"{name} must be {DECLARED[name].values}, got {os.environ[name]!r}")
    return value in _ON


def choice(name: str, settings: Mapping[str, T]) -> T | None:
    """The setting `name`'s value stands for in `settings`, None when unset or blank; any other
    value a ValueError."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return None
    if value not in settings:
        raise ValueError(f"{name} must be {DECLARED[name].values}, got {value!r}")
    return settings[value]


def integer(name: str, low: int, high: int) -> int | None:
    """`name` as a whole number from low to high, None when unset or blank; anything else a
    ValueError."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {value!r}")
    return number


def check_kernel_switches() -> None:
    """A ValueError for a kernel switch set to anything but 0 or 1 (the kernels would take it as on)."""
    for name in KERNEL_SWITCHES:
        switch(name)


def markdown_rows() -> str:
    """The table of VARIABLES as markdown (a header and one row a variable), for docs/kernels.md."""
    rows = ["| Variable | Values | Unset | What it does | Read by |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        rows.append(f"| `{v.name}` | {v.values} | {v.default} | {v.what} | {v.read_by} |")
    return "\n".join(rows) + "\n"
