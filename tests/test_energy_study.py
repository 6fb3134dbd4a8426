"""benchmarks/energy_study.py's measurement on the CPU, with a fake energy counter and clock."""

import importlib.util
import time
from pathlib import Path

STUDY_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "energy_study.py"
spec = importlib.util.spec_from_file_location("energy_study", STUDY_PATH)
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)


def test_measure_counts_only_the_timed_calls_and_divides_energy_by_them():
    watts = 500.0
    energy_mj = lambda: int(time.perf_counter() * watts * 1e3)  # noqa: E731 -- a counter at a steady 500 W
    calls = []

    def step():
        calls.append(time.perf_counter())
        time.sleep(0.005)

    ms, joules, mean_watts, mhz = study.measure(step, energy_mj, lambda: 1500, seconds=0.2, settle_s=0.1,
                                                 synchronize=lambda: None)
    timed = [t for t in calls if t >= calls[0] + 0.1]
    assert 5.0 <= ms < 10.0 and abs(len(timed) - 200 / ms) <= 2  # the settle's calls are not counted
    assert abs(mean_watts - watts) < 5 and abs(joules - watts * ms / 1e3) < 0.05 * joules
    assert mhz == 1500
