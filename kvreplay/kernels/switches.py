"""The environment's on/off switches (KVREPLAY_HUGE_PAGES, KVREPLAY_FUSED_DECODE, ...): 1 or unset
is on, 0 off, anything else a ValueError that names the variable, so that a mistyped value is an
error rather than a silent default."""
from __future__ import annotations

import os

# switches that the compiled kernels read themselves (getenv, once per process): checked here
# before a kernel loads, since the C++ side only knows whether the value is "0"
KERNEL_SWITCHES = ("KVREPLAY_AMX_PANELS", "KVREPLAY_AMX_ATTENTION")


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


def check_kernel_switches() -> None:
    """A ValueError for a kernel switch set to anything but 0 or 1 (the kernels would take it as on)."""
    for name in KERNEL_SWITCHES:
        switch(name)
