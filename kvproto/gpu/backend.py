"""Copy backends: where a block copy runs and how its completion is seen.

A backend submits a list of ``(dst, src)`` tensor copies as one unit and
returns a :class:`CopyHandle` whose completion is observed by polling
(:meth:`CopyHandle.query`) or waiting (:meth:`CopyHandle.wait`). ``src`` may
also be a function ``src(dst)`` that moves the bytes itself, run in the
unit's place (on the copy stream): a gather of blocks into ``dst``, or a
scatter from it.

* :class:`CudaBackend` — the copies are issued on a dedicated CUDA stream
  (``torch.cuda.Stream``) after it waits for the producing stream, and end in
  a ``torch.cuda.Event`` recorded on that stream. A copy on a stream cannot be
  stopped once submitted: :meth:`cancel` answers ``False`` and the copy's own
  event is the acknowledgement that it no longer writes. Host memory is
  page-locked (``pin_memory=True``); :func:`register_host` page-locks existing
  host memory (the store's shared-memory segment) with ``cudaHostRegister``
  through cuda-python, imported only here.
* :class:`CpuBackend` — the same contract on a CPU: one worker thread runs the
  copies in submission order (a stream), completion is a ``threading.Event``.
  A copy still queued can be stopped (:meth:`cancel` answers ``True``: it will
  never write); a running one cannot. Test hooks :meth:`CpuBackend.hold` /
  :meth:`CpuBackend.resume` stop the worker *inside* a copy, before it writes,
  so a test can make a completion arrive as late as it likes.

Neither backend knows generations: the copier (:mod:`kvproto.gpu.blocks`)
steps the pool machine and is the only one that decides what a completion means.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Optional, Sequence

Pairs = Sequence[tuple]   # (dst tensor, src tensor)


class CopyHandle:
    """A submitted unit of copies."""

    stopped = False   # True: cancelled before it ran; it never wrote

    def query(self) -> bool:   # pragma: no cover - interface
        raise NotImplementedError

    def wait(self, timeout: Optional[float]) -> bool:   # pragma: no cover - interface
        raise NotImplementedError


# --------------------------------------------------------------------------- CPU


class _CpuHandle(CopyHandle):
    __slots__ = ("pairs", "done", "state", "stopped")

    def __init__(self, pairs: Pairs) -> None:
        self.pairs = list(pairs)
        self.done = threading.Event()
        self.state = "queued"            # queued | running | done
        self.stopped = False

    def query(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: Optional[float]) -> bool:
        return self.done.wait(timeout)


class CpuBackend:
    """Copies on a worker thread, in order; completion is a ``threading.Event``."""

    kind = "cpu"

    def __init__(self) -> None:
        import torch
        self.device = torch.device("cpu")
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._gate = threading.Event()
        self._gate.set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvproto-gpu-cpu-stream")
        self._thread.start()

    def host_buffer(self, nbytes: int):
        import torch
        return torch.zeros(nbytes, dtype=torch.uint8)

    def submit(self, pairs: Pairs) -> CopyHandle:
        h = _CpuHandle(pairs)
        with self._cv:
            if self._closed:
                raise RuntimeError("backend closed")
            self._queue.append(h)
            self._cv.notify()
        return h

    def cancel(self, handle: CopyHandle) -> bool:
        """Stop ``handle`` if it has not started: True means it will never write."""
        with self._cv:
            if handle.state == "queued":
                handle.state, handle.stopped = "done", True
                try:
                    self._queue.remove(handle)
                except ValueError:
                    pass
                handle.done.set()
                return True
            return False

    def stall(self, seconds: float) -> None:
        """Delay every copy submitted after this by ``seconds`` (like a busy stream)."""
        h = _CpuHandle([("sleep", seconds)])
        with self._cv:
            self._queue.append(h)
            self._cv.notify()

    def hold(self) -> None:
        """Test hook: the next copy to run stops before writing, until :meth:`resume`."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def running(self) -> bool:
        """True while a copy has started and not finished (a test's sync point)."""
        with self._cv:
            return self._current is not None

    _current: Optional[_CpuHandle] = None

    def _run(self) -> None:
        import time
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed and not self._queue:
                    return
                h = self._queue.popleft()
                h.state = "running"
                self._current = h
            self._gate.wait()
            for dst, src in h.pairs:
                if isinstance(dst, str) and dst == "sleep":
                    time.sleep(src)
                elif callable(src):
                    src(dst)
                else:
                    dst.copy_(src)
            with self._cv:
                h.state = "done"
                self._current = None
            h.done.set()

    def synchronize(self) -> None:
        h = self.submit([])
        h.wait(None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._gate.set()
        self._thread.join(timeout=5)


# --------------------------------------------------------------------------- CUDA


class _CudaHandle(CopyHandle):
    __slots__ = ("event", "keep")

    def __init__(self, event, keep) -> None:
        self.event = event
        self.keep = keep                 # the tensors stay alive until the copy is done

    def query(self) -> bool:
        if self.event.query():
            self.keep = None
            return True
        return False

    def wait(self, timeout: Optional[float]) -> bool:
        if timeout is None:
            self.event.synchronize()
            return True
        import time
        end = time.monotonic() + timeout
        while True:
            if self.query():
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, 50e-6))


class CudaBackend:   # pragma: no cover - needs a CUDA device
    """Copies on a dedicated CUDA stream, each unit ending in a CUDA event."""

    kind = "cuda"

    def __init__(self, device: Any) -> None:
        import torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def host_buffer(self, nbytes: int):
        import torch
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)

    def submit(self, pairs: Pairs) -> CopyHandle:
        import torch
        producer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(producer)      # the KV the engine produced is complete
            for dst, src in pairs:
                if callable(src):
                    src(dst)
                else:
                    dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _CudaHandle(event, list(pairs))

    def cancel(self, handle: CopyHandle) -> bool:
        return False    # a submitted copy cannot be stopped: its event is the ack

    def stall(self, seconds: float, clock_hz: float = 2.0e9) -> None:
        """Busy the copy stream for about ``seconds`` (a spin kernel)."""
        import torch
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(int(seconds * clock_hz))

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.stream.synchronize()


def select_backend(device: Any = None):
    """:class:`CudaBackend` for a CUDA device, else :class:`CpuBackend`."""
    import torch
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda":
        return CudaBackend(dev)
    return CpuBackend()


# --------------------------------------------------------------------------- host registration


def _cudart():   # pragma: no cover - needs cuda-python
    try:
        from cuda.bindings import runtime as cudart   # cuda-python >= 12.6
    except ImportError:
        from cuda import cudart                       # older cuda-python
    return cudart


class HostRegistration:   # pragma: no cover - needs cuda-python and a CUDA device
    """Page-lock existing host memory (e.g. the store's shared-memory segment,
    a numpy array over it) with ``cudaHostRegister`` so device copies read and
    write it directly, with no staging copy. A read-only mapping is
    registered read-only. Unregisters on :meth:`close`."""

    def __init__(self, array) -> None:
        cudart = _cudart()
        self._cudart = cudart
        self.ptr = int(array.__array_interface__["data"][0])
        self.nbytes = int(array.nbytes)
        flags = cudart.cudaHostRegisterPortable
        if not array.flags.writeable:
            flags |= cudart.cudaHostRegisterReadOnly
        (err,) = cudart.cudaHostRegister(self.ptr, self.nbytes, flags)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        self._array = array

    def close(self) -> None:
        if self._array is not None:
            self._cudart.cudaHostUnregister(self.ptr)
            self._array = None

    def __enter__(self) -> "HostRegistration":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def register_host(array) -> HostRegistration:   # pragma: no cover - needs CUDA
    return HostRegistration(array)
