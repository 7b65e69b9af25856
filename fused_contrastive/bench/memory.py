"""Peak memory of one benchmark case, measured in the process that runs it.

* CPU: the case runs in a fresh process. Baseline = resident set (``VmRSS``) after a small warm-up
  and after the inputs exist; the high-water mark (``VmHWM``) is reset by writing 5 to
  ``/proc/self/clear_refs`` and peak = ``VmHWM`` after the phase - baseline. So peaks exclude the
  inputs and include everything the loss allocates, input gradients included. The cap (the memory
  budget, lowered to the memory available) is enforced as an address-space limit over the baseline,
  so a case that exceeds it fails with an allocation error instead of meeting the OOM killer.
* CUDA: ``torch.cuda.max_memory_allocated`` over ``memory_allocated`` after the inputs.
* Any device, in process and deterministic: :class:`LiveBytes`, the high-water mark of the bytes of the
  tensor storages that ATen ops create while it is active (freed ones subtracted when they die).
"""

from __future__ import annotations

import gc
import resource
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM and VmSize of this process in bytes (Linux ``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmSize"):
                out[key] = int(val.split()[0]) * 1024
    return out


def mem_available() -> float | None:
    """MemAvailable of the machine in bytes (None where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return None


class CpuMeter:
    """Peak RSS over a baseline in this (fresh) process; see the module docstring."""

    method = ("CPU: fresh process per case; peak = VmHWM - VmRSS after inputs, VmHWM reset through "
              "/proc/self/clear_refs; cap = address-space limit over the baseline")

    def __init__(self, isolated: bool) -> None:
        self.base = 0
        self.isolated = isolated
        if not isolated:
            self.method = ("CPU inline (not isolated): VmHWM - VmRSS after inputs; memory freed and cached "
                           "by earlier cases may hide allocations")

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")

    def start(self, cap: float) -> None:
        gc.collect()
        st = proc_status()
        self.base = st["VmRSS"]
        self._reset()
        if not self.isolated:
            return
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = int(st["VmSize"] + cap)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    def peak(self) -> int:
        return max(0, proc_status()["VmHWM"] - self.base)

    def next_phase(self) -> None:
        self._reset()

    def sync(self) -> None:
        pass


class CudaMeter:
    method = "CUDA: torch.cuda.max_memory_allocated - memory_allocated after the inputs"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def start(self, cap: float) -> None:
        gc.collect()
        self.sync()
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        self.sync()
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)

    def next_phase(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def meter(device: torch.device, isolated: bool):
    return CudaMeter(device) if device.type == "cuda" else CpuMeter(isolated)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in msg for s in ("can't allocate memory", "out of memory", "not enough memory", "cannot allocate memory"))


def step_peak(device: str, step) -> int:
    """Peak memory of one call of ``step()`` in this (fresh) process, over what is allocated before it:
    the CPU meter's resident-set high-water mark (address space capped 64 GiB above the baseline) or
    the CUDA allocator's peak."""
    m = meter(torch.device(device), isolated=True)
    m.start(float("inf") if device != "cpu" else 64 * (1 << 30))
    step()
    m.sync()
    return m.peak()


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: step()`` -> ``m.peak``: the largest sum of the bytes of live tensor storages
    created inside the block (``m.live``: those still alive). Every ATen op's outputs are seen (backward
    ops included); an output whose storage is new (not one of the op's inputs' and not already counted)
    adds its ``nbytes`` until the storage dies (a ``weakref.finalize`` on it: views and tensors saved for
    backward keep it alive). Tensors that existed before the block count nothing, so the peak excludes
    the inputs and includes the gradients the step allocates. Deterministic (no allocator or page-cache
    state); memory a kernel allocates outside ATen's ops (a library's scratch) is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = set()
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and not a.is_sparse:
                given.add(a.untyped_storage()._cdata)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.is_sparse:
                continue
            s = t.untyped_storage()
            key = s._cdata
            if key in given or key in self._sizes or s.nbytes() == 0:
                continue
            self._sizes[key] = s.nbytes()
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(s, self._freed, key)
        return out
