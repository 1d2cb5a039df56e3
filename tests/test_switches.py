"""The environment's on/off switches: 1 or unset on, 0 off, anything else a clear ValueError."""
from __future__ import annotations

import pytest
import torch

from kvreplay.kernels import huge_pages
from kvreplay.kernels import cpu_kernels
from kvreplay.kernels.switches import KERNEL_SWITCHES, check_kernel_switches, switch


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("1", True), (" 0 ", False), ("0", False)])
def test_switch_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("KVREPLAY_SOME_SWITCH", raising=False)
    else:
        monkeypatch.setenv("KVREPLAY_SOME_SWITCH", value)
    assert switch("KVREPLAY_SOME_SWITCH") is on


@pytest.mark.parametrize("value", ["2", "yes", "off", "true", "O"])
def test_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv("KVREPLAY_SOME_SWITCH", value)
    with pytest.raises(ValueError, match=f"KVREPLAY_SOME_SWITCH must be 0 or 1, got '{value}'"):
        switch("KVREPLAY_SOME_SWITCH")


def test_huge_pages_switch_is_checked(monkeypatch):
    monkeypatch.setenv("KVREPLAY_HUGE_PAGES", "no")
    with pytest.raises(ValueError, match="KVREPLAY_HUGE_PAGES must be 0 or 1"):
        huge_pages.empty(4 << 20, dtype=torch.uint8)
    monkeypatch.setenv("KVREPLAY_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    assert huge_pages.empty(4 << 20, dtype=torch.uint8).numel() == 4 << 20


@pytest.mark.parametrize("name", KERNEL_SWITCHES)
def test_kernel_switches_are_checked_before_a_kernel_loads(monkeypatch, name):
    monkeypatch.setenv(name, "off")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 'off'"):
        check_kernel_switches()
    if cpu_kernels.enabled():
        with pytest.raises(ValueError, match=name):
            cpu_kernels.layer_ops()
    monkeypatch.setenv(name, "0")
    check_kernel_switches()


@pytest.mark.parametrize("value, on", [("", True), ("1", True), ("ON", True), ("yes", True),
                                       ("0", False), ("false", False), ("Off", False)])
def test_cpu_kernels_switch(monkeypatch, value, on):
    monkeypatch.setenv("KVREPLAY_CPU_KERNELS", value)
    assert cpu_kernels.enabled() is on


def test_cpu_kernels_switch_refuses_a_typo(monkeypatch):
    monkeypatch.setenv("KVREPLAY_CPU_KERNELS", "fasle")
    with pytest.raises(ValueError, match="KVREPLAY_CPU_KERNELS must be 1 or 0 .*got 'fasle'"):
        cpu_kernels.enabled()
    with pytest.raises(ValueError, match="KVREPLAY_CPU_KERNELS"):
        cpu_kernels.layer_ops()
