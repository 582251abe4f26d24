"""The host memory read shared by the KV budget, `sim whatif --jobs` and the reports."""
import builtins
import os

import pytest

from everybyte.native import host_memory


def test_available_is_positive_and_at_most_total():
    total, available = host_memory.total_memory_bytes(), host_memory.available_memory_bytes()
    assert total is not None and available is not None
    assert 0 < available <= total


def test_without_proc_meminfo_it_falls_back_to_physical_pages(monkeypatch):
    real_open = builtins.open

    def no_meminfo(path, *a, **k):
        if str(path) == "/proc/meminfo":
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    page = os.sysconf("SC_PAGE_SIZE")
    assert host_memory.total_memory_bytes() == os.sysconf("SC_PHYS_PAGES") * page
    free = host_memory.available_memory_bytes()
    assert free is not None and free % page == 0


def test_nothing_known_is_none(monkeypatch):
    monkeypatch.setattr(host_memory, "_meminfo", lambda field: None)

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    assert host_memory.total_memory_bytes() is None and host_memory.available_memory_bytes() is None


@pytest.mark.parametrize("field", ["MemTotal", "MemAvailable"])
def test_figures_are_those_of_proc_meminfo(field):
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    read = host_memory.total_memory_bytes if field == "MemTotal" else host_memory.available_memory_bytes
    got = read()
    assert got is not None
    if field == "MemTotal":
        assert got == kib * 1024
    else:                                       # moves while the test runs
        assert abs(got - kib * 1024) < 512 << 20
