"""Energy per step of ours, ours-fp8 and the four-GEMM floor, read from NVML's energy counter.

Session 6 found the H200 power capped throughout a settled bench (SM clock 1260-1620 MHz, "SW power
cap", NOTES item 35). Under a cap a step's speed follows its energy: time ~ energy / cap. This measures,
per provider and T, after a settle: ms per call, J per call, mean W and the mean SM clock, over calls
run back to back for ``--seconds``.
Prediction: every provider runs near the same mean power (the cap, 600-700 W); ours' J per call over
the floor's within 2% of its time ratio (1.09-1.11 at the seed shape, s6g); ours-fp8 at ~0.92x the
floor's J or less (FP8 tensor cores do more per joule). If ours' energy ratio is well above its
time ratio at full clock (1.04-1.06 in s5f), energy is the lever to chase (bytes and instructions of
the row step), not latency.

    PYTHONPATH=src python benchmarks/energy_study.py [--tokens 1024 4096] [--seconds 2] [--settle-s 3]
"""

import argparse
import ctypes
import time

import torch

from cosdistill.bench import CUDA_WORKLOAD, FP8_SETTING, floor_provider, make_tensors, ours_provider, ours_settings

NVML_CLOCK_SM = 1


class Nvml:
    """The few NVML calls needed, through the driver's libnvidia-ml (no Python package)."""

    def __init__(self, index: int):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2())
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)))

    @staticmethod
    def _check(status):
        if status != 0:
            raise RuntimeError(f"NVML call failed with status {status}")

    def energy_mj(self) -> int:
        value = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)))
        return value.value

    def sm_clock_mhz(self) -> int:
        value = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(value)))
        return value.value


def measure(step, energy_mj, sm_clock_mhz, seconds, settle_s, synchronize):
    """(ms per call, J per call, mean W, mean SM MHz) over calls run back to back for >= ``seconds``,
    after ``settle_s`` of the same calls. The energy counter updates every few ms: long windows only."""
    start = time.perf_counter()
    while time.perf_counter() - start < settle_s:
        step()
        synchronize()
    clocks, calls = [], 0
    energy_start, start = energy_mj(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        calls += 1
        if calls % 4 == 0:
            synchronize()
            clocks.append(sm_clock_mhz())
    synchronize()
    elapsed, joules = time.perf_counter() - start, (energy_mj() - energy_start) / 1e3
    return 1e3 * elapsed / calls, joules / calls, joules / elapsed, sum(clocks) / max(1, len(clocks))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    nvml = Nvml(device.index or 0)
    workload = CUDA_WORKLOAD
    providers = {"ours": ours_provider(ours_settings()[0]), "ours-fp8": ours_provider(FP8_SETTING), "floor": floor_provider}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; seed shape, full step")
    print("| T | provider | ms per call | J per call | mean W | mean SM MHz | J x floor | ms x floor |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for tokens in args.tokens:
        tensors = make_tensors(tokens, workload.vocab, workload.hidden, workload.student_hidden, workload.dtype, device)
        results = {}
        for name, build in providers.items():
            step = build(tensors, "full")

            def cleared_step(step=step, tensors=tensors):
                tensors.clear_grads()
                step()

            results[name] = measure(cleared_step, nvml.energy_mj, nvml.sm_clock_mhz, args.seconds, args.settle_s,
                                    torch.cuda.synchronize)
        floor_ms, floor_j = results["floor"][:2]
        for name, (ms, joules, watts, mhz) in results.items():
            print(f"| {tokens} | {name} | {ms:.3f} | {joules:.3f} | {watts:.0f} | {mhz:.0f} | {joules / floor_j:.3f} | "
                  f"{ms / floor_ms:.3f} |")


if __name__ == "__main__":
    main()
