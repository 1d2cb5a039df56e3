"""2 MiB pages for the KV pool and the panel copies (kvreplay/huge_pages.py)."""
import sys
from pathlib import Path

import pytest
import torch

from kvreplay.kernels import huge_pages
from kvreplay.kv.manager import KVManager

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _huge_kib() -> int:
    """AnonHugePages of this process, in KiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.delenv("KVREPLAY_HUGE_PAGES", raising=False)
    return monkeypatch


def test_zeros_is_zeros_on_any_machine(fresh):
    t = huge_pages.zeros(3, 1 << 20, dtype=torch.bfloat16)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[2, -1] = 5  # writable to its last element
    assert t.sum().item() == 5
    small = huge_pages.zeros(2, 3, dtype=torch.float32)  # under one 2 MiB page: plain torch.zeros
    assert small.shape == (2, 3) and not small.any()
    assert huge_pages.empty(0, dtype=torch.float32).numel() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("madvise", "always"),
                    reason="transparent huge pages are off here")
def test_buffers_land_on_huge_pages_where_linux_gives_them(fresh):
    """Fresh memory is mapped for each buffer, so the advice holds even where the allocator would
    hand back memory it had touched before (it did in the full test run)."""
    before = _huge_kib()
    big = huge_pages.zeros(16 << 20, dtype=torch.uint8)  # 16 MiB: eight 2 MiB pages
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert _huge_kib() - before >= 4 * 2048  # most of them (the kernel may fall back for a few)
    manager = KVManager(num_blocks=1024, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64,
                        dtype=torch.bfloat16)  # 8 MiB a layer
    assert all(not cache.any() and cache.data_ptr() % huge_pages.HUGE_PAGE == 0 for cache in manager.kv_caches)
    assert _huge_kib() - before >= 4 * 2048 + 4 * 2048
    del big, manager


def _huge_kib_of(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings under `t`'s bytes, in KiB: unlike the process's total, it
    does not move when khugepaged collapses some other buffer meanwhile."""
    start, end, total, inside = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_switched_off_by_environment(fresh):
    """Checked in a fresh process: in this one the allocator may hand back memory an earlier
    test advised for huge pages, which khugepaged then fills whatever the switch says."""
    import os
    import subprocess
    fresh.setenv("KVREPLAY_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from test_huge_pages import _huge_kib_of; "
            "from kvreplay.kernels import huge_pages; assert not huge_pages.enabled(); "
            "t = huge_pages.zeros(16 << 20, dtype=torch.uint8); print(int(t.any()), _huge_kib_of(t))")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "KVREPLAY_HUGE_PAGES": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    nonzero, huge_kib = map(int, out.stdout.split())
    assert not nonzero and huge_kib < 4 * 2048


def test_panel_copies_move_into_one_buffer_unchanged(fresh):
    """onto_huge_pages: each projection's panels become a view of one buffer (64-byte aligned),
    with the same shape, dtype and bytes, and the products give the same bits."""
    from kvreplay.layers.linear import Projection, onto_huge_pages
    gen = torch.Generator().manual_seed(0)
    projections = [Projection((torch.randn(n, 64, generator=gen) * 0.1).bfloat16()) for n in (32, 48, 112)]
    if any(p.panels is None for p in projections):
        pytest.skip("no panel kernel here")
    before = [p.panels.clone() for p in projections]
    x = torch.randn(5, 64, generator=gen).bfloat16()
    outputs = [p(x) for p in projections]
    moved = onto_huge_pages(projections + [Projection(torch.randn(8, 8))])  # one without panels
    assert moved == sum(-(-b.numel() * b.element_size() // 64) * 64 for b in before)
    storages = {p.panels.untyped_storage().data_ptr() for p in projections}
    assert len(storages) == 1
    for p, b, out in zip(projections, before, outputs):
        assert p.panels.data_ptr() % 64 == 0 and p.panels.is_contiguous()
        assert torch.equal(p.panels, b) and torch.equal(p(x), out)
    assert onto_huge_pages([]) == 0
