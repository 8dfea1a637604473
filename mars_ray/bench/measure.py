"""What the offline benchmarks (`mars-ray bench decode|forward`) measure with and where they write it:
forwards counted through a hook, peak memory, the device line, the JSON report."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from mars_ray.bench.machine import cpu_name
from mars_ray.core.decode_state import DecodeResult


class ForwardCounter:
    """Counts model calls and the rows in each, through a forward hook."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = self.rows = 0
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.rows += int(ids.shape[0]) if ids is not None else 1

    def close(self) -> None:
        self._handle.remove()


class ReportedForwards:
    """Forwards as the decoder reports them per row (`DecodeResult.forward_passes`), for an engine whose model
    calls no hook sees (vLLM runs them in its own process): the rows only, the calls unknown."""

    calls: int | None = None

    def __init__(self) -> None:
        self.rows = 0

    def add(self, results: Sequence[DecodeResult]) -> None:
        self.rows += sum(r.forward_passes for r in results)

    def close(self) -> None:
        """Nothing to unhook (as `ForwardCounter.close`)."""


class PeakMemory:
    """Peak memory above the start: CUDA allocator statistics, or the kernel's peak RSS on CPU.

    On CPU the peak is Linux's resettable high-water mark (VmHWM, reset through /proc/self/clear_refs), read
    once at the end: a sampling thread would fight the decode loop for the GIL and slow what it measures
    (the serving engine, whose forward runs in a worker thread, ran at a fraction of its speed beside one).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = _proc_status_bytes("VmRSS")
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self.peak = _proc_status_bytes("VmHWM") - self._base

    @property
    def megabytes(self) -> float:
        return max(self.peak, 0) / 2**20


def _proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status in bytes (0 where there is no procfs)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it times the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_line(device: torch.device) -> str:
    """The GPU's name, or the CPU's with the torch threads it ran on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} torch threads"


def write_json(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
