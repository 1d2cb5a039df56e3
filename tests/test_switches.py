"""The environment's on/off switches: 1 or unset on, 0 off, anything else a clear ValueError."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvreplay.kernels import huge_pages
from kvreplay.kernels import cpu_kernels
from kvreplay.kernels.switches import (DECLARED, KERNEL_SWITCHES, VARIABLES, check_kernel_switches, choice,
                                       integer, markdown_rows, switch)


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


def test_every_variable_read_is_declared_once():
    """Every KVREPLAY_* name the package's Python names (and Triton's TRITON_INTERPRET, which it
    reads), and every one its kernels read with getenv, has its row in switches.VARIABLES (one
    row each)."""
    package = Path(__file__).resolve().parent.parent / "kvreplay"
    named = set()
    for path in package.rglob("*.py"):
        named |= set(re.findall(r"KVREPLAY_[A-Z0-9_]+|TRITON_INTERPRET", path.read_text()))
    for path in (package / "kernels" / "csrc").iterdir():
        named |= set(re.findall(r'switched_off\("(KVREPLAY_[A-Z0-9_]+)"', path.read_text()))
    assert len(DECLARED) == len(VARIABLES)
    assert named == set(DECLARED)
    assert set(KERNEL_SWITCHES) == {"KVREPLAY_AMX_PANELS", "KVREPLAY_AMX_ATTENTION"}


def test_markdown_rows_list_every_variable():
    rows = markdown_rows().splitlines()
    assert rows[0].startswith("| Variable |") and len(rows) == 2 + len(VARIABLES)
    assert all(f"`{v.name}`" in row for v, row in zip(VARIABLES, rows[2:]))


def test_docs_show_the_declared_table():
    """docs/kernels.md's table of variables is the one switches.py declares, as rendered."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "kernels.md").read_text()
    assert markdown_rows() in page


def test_choice_and_integer_readers(monkeypatch):
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", " 16 ")
    assert choice("KVREPLAY_INT_PRODUCTS", {"16": 16}) == 16
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", "4")
    with pytest.raises(ValueError, match=r"KVREPLAY_INT_PRODUCTS must be 0, 1 \(16-bit x\), 16 or 8, got '4'"):
        choice("KVREPLAY_INT_PRODUCTS", {"16": 16})
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", "")
    assert choice("KVREPLAY_INT_PRODUCTS", {"16": 16}) is None
    monkeypatch.delenv("KVREPLAY_PANEL_ROWS", raising=False)
    assert integer("KVREPLAY_PANEL_ROWS", 0, 128) is None
    monkeypatch.setenv("KVREPLAY_PANEL_ROWS", "128")
    assert integer("KVREPLAY_PANEL_ROWS", 0, 128) == 128
    for value in ("129", "-1", "eight"):
        monkeypatch.setenv("KVREPLAY_PANEL_ROWS", value)
        with pytest.raises(ValueError, match=f"KVREPLAY_PANEL_ROWS must be an integer from 0 to 128, got '{value}'"):
            integer("KVREPLAY_PANEL_ROWS", 0, 128)
