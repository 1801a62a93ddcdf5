"""bench/host.py reads the hypervisor's steal from /proc/stat's aggregate line."""

from __future__ import annotations

import sys

import pytest

from bench import host

LINE = "cpu  {} 0 {} {} 10 0 5 {} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def test_steal_share_is_stolen_ticks_over_all_ticks(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    monkeypatch.setattr(host, "PROC_STAT", stat)
    stat.write_text(LINE.format(1000, 200, 5000, 300))
    before = host.cpu_counters()
    assert before == [1000, 0, 200, 5000, 10, 0, 5, 300, 0, 0]
    stat.write_text(LINE.format(1600, 300, 5200, 400))  # +600 user +100 sys +200 idle +100 steal
    assert host.steal_share(before, host.cpu_counters()) == pytest.approx(100 / 1000)


def test_unknown_counters_give_no_share(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "PROC_STAT", tmp_path / "missing")
    assert host.cpu_counters() is None
    assert host.steal_share(None, [0] * 10) is None
    (tmp_path / "short").write_text("cpu 1 2 3\n")
    monkeypatch.setattr(host, "PROC_STAT", tmp_path / "short")
    assert host.cpu_counters() is None
    assert host.steal_share([5] * 10, [5] * 10) is None  # no time passed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_this_host_reports_a_share_between_0_and_1():
    before = host.cpu_counters()
    assert before is not None and len(before) > host.STEAL
    after = before
    while sum(after[: host.STEAL + 1]) == sum(before[: host.STEAL + 1]):  # one tick passes
        after = host.cpu_counters()
    assert 0.0 <= host.steal_share(before, after) <= 1.0


def test_share_text_is_a_whole_percent_or_a_dash():
    assert host.share_text(0.294) == "29%" and host.share_text(0.0) == "0%"
    assert host.share_text(None) == "-"
