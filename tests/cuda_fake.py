"""A strict fake of CUDA's driver layer, so that a CPU-only torch runs every CUDA-only branch.

    gpu = FakeCuda(monkeypatch, capability=(9, 0), total=80 * GiB)   # one H100, as torch sees it

Only what a CUDA build of torch gets from its C++ extension and the CUDA runtime is replaced: the
torch._C._cuda_* functions, torch.cuda's bound copies of two of them (_exchange_device,
_maybe_exchange_device), the runtime module (torch.cuda.cudart(): cudaMemGetInfo), what
torch._C._cuda_init sets on torch.cuda (_get_device_properties, default_generators) and NVML's
device count. Every function of torch.cuda (is_available, current_device, mem_get_info,
memory_reserved, get_per_process_memory_fraction, empty_cache, get_device_capability,
max_memory_allocated, synchronize, ...) is torch's own and runs as on a GPU: its lazy init, and its
argument checks, which is where `get_per_process_memory_fraction("cuda")` raises. The driver
functions are strict too: a device index that is not an int, or not a device, is an error, as the
C++ binding's. Tensors cannot go to the fake device (a CPU build has no CUDA kernels): a run under
the fake keeps its tensors on the CPU while torch.cuda believes in the GPU (test_cuda.on_the_cpu).

The fake also records, by the caller's file and line, each call of a torch.cuda function that the
project calls somewhere (call_sites): tests/test_cuda.py checks that strict tests reach every one.
"""
import ast
import functools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

GiB = 2 ** 30
ROOT = Path(__file__).resolve().parent.parent
REACHED = set()  # (file, line) of every call of a recorded torch.cuda function, from any test


class FakeCuda:
    """`count` GPUs of one kind, as torch sees them: capability (major, minor), `total` bytes, of
    which `free` are free (the rest taken by other processes) and `reserved` held by this process's
    caching allocator (and `allocated` of those by tensors). `calls` lists the driver calls made."""

    def __init__(self, monkeypatch, count=1, capability=(9, 0), total=80 * GiB, free=None,
                 reserved=0, allocated=0, name="NVIDIA H100 80GB HBM3"):
        self.count, self.capability, self.total, self.name = count, capability, total, name
        self.free = total if free is None else free
        self.reserved, self.allocated = reserved, allocated
        self.current, self.fraction, self.calls = 0, {i: 1.0 for i in range(count)}, []
        self.peak = {"allocated": allocated, "reserved": reserved}
        self._install(monkeypatch)

    # ------------------------------------------------------------------ the driver layer

    def _index(self, i):
        """As the C++ binding checks a device index: an int (not a torch.device, not None)."""
        if type(i) is not int:
            raise TypeError(f"fake CUDA driver: a device index must be an int, got {i!r}")
        if not 0 <= i < self.count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return i

    def _driver(self, name):
        """torch._C._cuda_<name>, recorded in self.calls."""
        def call(*args):
            self.calls.append((name, *args))
            return getattr(self, "_" + name)(*args)
        return call

    def _getDeviceCount(self):
        return self.count

    def _init(self):  # what the C++ init sets on torch.cuda
        self.monkeypatch.setattr(torch.cuda, "_get_device_properties", self.properties,
                                 raising=False)
        self.monkeypatch.setattr(torch.cuda, "default_generators",
                                 tuple(torch.Generator() for _ in range(self.count)))

    def _getDevice(self):
        return self.current

    def _setDevice(self, i):
        self.current = self._index(i)

    def _exchange(self, i):  # torch.cuda._exchange_device: select i, return the one before
        if i < 0:
            return -1
        before, self.current = self.current, self._index(i)
        return before

    def _getMemoryFraction(self, i):
        return self.fraction[self._index(i)]

    def _setMemoryFraction(self, fraction, i):
        self.fraction[self._index(i)] = fraction

    def _memoryStats(self, i):
        self._index(i)
        return {"allocated_bytes": {"all": {"current": self.allocated,
                                            "peak": self.peak["allocated"]}},
                "reserved_bytes": {"all": {"current": self.reserved,
                                           "peak": self.peak["reserved"]}}}

    def _resetPeakMemoryStats(self, i):
        self._index(i)
        self.peak = {"allocated": self.allocated, "reserved": self.reserved}

    def _emptyCache(self):
        self.reserved = self.allocated  # the cached blocks go back to the device

    def _synchronize(self):
        pass

    def properties(self, i):
        self._index(i)
        major, minor = self.capability
        return SimpleNamespace(name=self.name, major=major, minor=minor,
                               total_memory=self.total, multi_processor_count=132,
                               is_integrated=False)

    def _install(self, monkeypatch):
        self.monkeypatch = m = monkeypatch
        for name in ("getDeviceCount", "init", "getDevice", "setDevice", "getMemoryFraction",
                     "setMemoryFraction", "memoryStats", "resetPeakMemoryStats", "emptyCache",
                     "synchronize"):
            m.setattr(torch._C, "_cuda_" + name, self._driver(name), raising=False)
        for name in ("_exchange_device", "_maybe_exchange_device"):
            m.setattr(torch.cuda, name, self._driver("exchange"))
        m.setattr(torch.cuda, "_cudart", SimpleNamespace(cudaMemGetInfo=self._driver("memGetInfo")))
        m.setattr(torch.cuda, "_device_count_nvml", lambda: -1)  # NVML: not found
        # torch.cuda's own state, as in a fresh process; put back afterwards
        m.setattr(torch.cuda, "_initialized", False)
        m.setattr(torch.cuda, "_cached_device_count", None)
        m.setattr(torch.cuda, "_queued_calls", [])
        for name in recorded_names():
            real = getattr(torch.cuda, name)
            m.setattr(torch.cuda, name, recorder(real))

    def _memGetInfo(self, i):  # cudaMemGetInfo: (free, total) of device i, for every process
        self._index(i)
        return self.free, self.total


# -----------------------------------------------------------------------------
# the project's torch.cuda calls, and which of them a test reached


def project_files(root=ROOT):
    """Every .py of the project, outside tests/, out/ and hidden or virtualenv folders."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("tests", "out", "__pycache__")
                         and not d.startswith(".")
                         and not os.path.isfile(os.path.join(folder, d, "pyvenv.cfg")))
        yield from (Path(folder) / f for f in sorted(files) if f.endswith(".py"))


def call_sites(root=ROOT):
    """[(path relative to root, first line, last line, name)] of every torch.cuda.<name>(...) call
    in the project's code."""
    sites = []
    for path in project_files(root):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            f = node.func if isinstance(node, ast.Call) else None
            if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute)
                    and f.value.attr == "cuda" and isinstance(f.value.value, ast.Name)
                    and f.value.value.id == "torch"):
                sites.append((str(path.relative_to(root)), node.lineno, node.end_lineno, f.attr))
    return sorted(sites)


@functools.lru_cache(maxsize=None)
def recorded_names():
    return tuple(sorted({name for *_, name in call_sites()}))


def recorder(real):
    """real, recording the file and line it is called from."""
    @functools.wraps(real)
    def call(*args, **kwargs):
        caller = sys._getframe(1)
        REACHED.add((os.path.realpath(caller.f_code.co_filename), caller.f_lineno))
        return real(*args, **kwargs)
    return call


def reached(site, root=ROOT):
    """Did a test under the fake call this site (path, first line, last line, name)?"""
    path, first, last, _ = site
    where = os.path.realpath(root / path)
    return any(f == where and first <= line <= last for f, line in REACHED)
