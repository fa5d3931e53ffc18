"""The soak's verdicts (bench/soak.py `analyse`) on hand-made samples: a saw-tooth from returning freed heap
after each checkpoint holds, rising peaks fail; throughput windows and version gaps are judged as stated."""

import pytest

from bench.soak import RSS_BAND, analyse


def _samples(rss: list[float], every: float = 60.0) -> list[dict]:
    return [{"t": i * every, "wall": i * every, "trainer": x, "engines": []} for i, x in enumerate(rss)]


def _steps(n: int, every: float = 1.0) -> list[dict]:
    return [{"step": i + 1, "time": i * every} for i in range(n)]


def test_a_saw_tooth_between_checkpoints_holds_its_peak():
    # warm-up 0..8, then troughs of 900 and peaks of 1400 MiB in both judged thirds
    rss = [500.0] * 9 + [900.0, 1400.0] * 9
    rss = rss[:27]
    v = analyse(_samples(rss), _steps(100), batch=16, window_s=10.0)
    assert v["rss_peak_mib"] == [1400.0, 1400.0]
    assert v["rss_peak_growth"] == pytest.approx(0.0)
    assert v["memory_ok"]


def test_rising_peaks_fail_the_memory_verdict():
    # samples at t = 0..29 min: second third [10, 20) peaks at 1000, last third [20, 29] reaches 1000 * (1 + band) + 50
    rss = [1000.0] * 20 + [1000.0 + 15.0 * i for i in range(10)]
    v = analyse(_samples(rss), _steps(100), batch=16, window_s=10.0)
    assert v["rss_peak_mib"] == [1000.0, 1135.0]
    assert v["rss_peak_growth"] == pytest.approx(0.135)
    assert v["rss_peak_growth"] > RSS_BAND and not v["memory_ok"]
    assert v["rss_slope_mib_per_min"] > 0


def test_throughput_windows_and_versions():
    # 100 steps one second apart, windows of 10 s: windows 1..8 are full (the first is warm-up, the last partial)
    v = analyse(_samples([1000.0] * 30), _steps(100), batch=16, window_s=10.0)
    assert v["traj_per_s_windows"] == [16.0] * 8
    assert v["traj_per_s_median"] == 16.0 and v["rate_spread"] == 0.0 and v["throughput_ok"]
    assert v["versions"] == 100 and v["versions_ok"]
    skipped = _steps(100)
    skipped[50]["step"] = 52
    assert not analyse(_samples([1000.0] * 30), skipped, batch=16, window_s=10.0)["versions_ok"]
