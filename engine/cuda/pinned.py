"""Page-locked host memory mapped into the GPU's address space, and the slots
that carry batches through it.

A :class:`HostBuffer` is allocated with ``cudaHostAlloc(Mapped | Portable)``
through ``cuda.bindings`` (NVIDIA's cuda-python) when it is installed, else
with torch's pinned allocator (with unified addressing, which every 64-bit
CUDA platform has, pinned memory is mapped as well). It offers three views
of the same bytes: numpy (the host writes a batch there), a CPU tensor (the
end of non-blocking copies) and a CUDA tensor (kernels read it in place:
zero-copy).

A :class:`Slot` is one batch's buffers and the CUDA events that fence and
time it; a :class:`SlotRing` hands two out in turn, so that batch n+1 is
written while batch n computes.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Any

import numpy as np
import torch

log = logging.getLogger("berth.engine")


def cuda_runtime() -> Any | None:
    """cuda.bindings' runtime module, or None where cuda-python is missing."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime


def _check(runtime: Any, what: str, result: tuple[Any, ...]) -> Any:
    err, *values = result
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {err}")
    return values[0] if values else None


class _DeviceArray:
    """Mapped host bytes described to torch (CUDA array interface, version 2);
    holds the memory's owner, so the CUDA tensor keeps the memory alive."""

    def __init__(self, pointer: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 2,
        }


class _Allocation:
    """One cudaHostAlloc block, freed once nothing refers to it any more."""

    def __init__(self, runtime: Any, nbytes: int) -> None:
        flags = runtime.cudaHostAllocMapped | runtime.cudaHostAllocPortable
        alloc = runtime.cudaHostAlloc(nbytes, flags)
        self.host = int(_check(runtime, "cudaHostAlloc", alloc))
        free = weakref.finalize(self, runtime.cudaFreeHost, self.host)
        free.atexit = False  # the runtime may be gone at exit; the OS frees
        mapped = runtime.cudaHostGetDevicePointer(self.host, 0)
        self.device = int(_check(runtime, "cudaHostGetDevicePointer", mapped))


class HostBuffer:
    """One page-locked host allocation, mapped into the device's address space.

    Every view (numpy, CPU and CUDA tensors) keeps the memory alive."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        runtime = cuda_runtime()
        owner: object
        if runtime is not None:
            self.allocator = "cuda.bindings"
            allocation = _Allocation(runtime, nbytes)
            raw = (ctypes.c_uint8 * nbytes).from_address(allocation.host)
            setattr(raw, "owner", allocation)  # noqa: B010 (numpy keeps raw alive)
            self.numpy = np.ctypeslib.as_array(raw)
            self.cpu = torch.from_numpy(self.numpy)
            owner, pointer = allocation, allocation.device
        else:
            self.allocator = "torch"
            self.cpu = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.numpy = self.cpu.numpy()
            owner, pointer = self.cpu, self.cpu.data_ptr()
        self.numpy[:] = 0  # never let a kernel read uninitialized ids
        array = _DeviceArray(pointer, nbytes, owner)
        self.cuda = torch.as_tensor(array, device=device)
        self.nbytes = nbytes


class Slot:
    """One batch in flight: pinned int32 input, float32 output, timing events."""

    def __init__(
        self, io_elements: int, out_elements: int, device: torch.device
    ) -> None:
        self._io = HostBuffer(4 * io_elements, device)
        self._out = HostBuffer(4 * out_elements, device)
        self.allocator = self._io.allocator
        self.io = self._io.numpy.view(np.int32)  # the host writes a batch here
        self.io_cpu = self._io.cpu.view(torch.int32)  # staging copies read this
        self.io_cuda = self._io.cuda.view(torch.int32)  # zero-copy graphs read this
        self.out = self._out.numpy.view(np.float32)  # the host reads results here
        self.out_cpu = self._out.cpu.view(torch.float32)  # staging copies write this
        self.out_cuda = self._out.cuda.view(
            torch.float32
        )  # zero-copy graphs write this
        # copy in starts, compute starts, compute ends, copy out ends.
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self.staged = True  # False: one zero-copy replay, timed by two events
        self.busy = False

    def times(self) -> tuple[float, float, float]:
        """Seconds of (copy in, compute, copy out) of the batch just finished."""
        copy_in, compute, computed, copied = self.events
        if not self.staged:  # copies were the graph's own reads and writes
            return 0.0, compute.elapsed_time(copied) / 1e3, 0.0
        return (
            copy_in.elapsed_time(compute) / 1e3,
            compute.elapsed_time(computed) / 1e3,
            computed.elapsed_time(copied) / 1e3,
        )


class SlotRing:
    """Slots taken in turn, so one fills while the one before computes."""

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots
        self._next = 0

    def take(self) -> tuple[int, Slot]:
        index = self._next
        slot = self.slots[index]
        if slot.busy:
            raise RuntimeError(
                f"pinned slot {index} still holds an uncollected batch: collect "
                f"each batch before submitting {len(self.slots)} more"
            )
        slot.busy = True
        self._next = (index + 1) % len(self.slots)
        return index, slot
