"""Device-side KV blocks: move an engine's paged KV cache between the device
and the store's host memory under the Timeout protocol (see ``docs/gpu.md``).

Needs torch (the ``gpu`` extra); cuda-python only for :func:`register_host`.
Without a CUDA device everything runs on the CPU path with the same semantics.
"""

from kvproto.gpu.layout import KVLayout
from kvproto.gpu.backend import CpuBackend, CudaBackend, HostRegistration, register_host, select_backend
from kvproto.gpu.blocks import BlockPool, Copier, DeviceCopy, StagingBuffers
from kvproto.gpu.chains import DeviceKV, DeviceRequest, RestoreChain, RestoreState, SaveChain, SaveState

__all__ = ["KVLayout", "CpuBackend", "CudaBackend", "HostRegistration", "register_host", "select_backend",
           "BlockPool", "Copier", "DeviceCopy", "StagingBuffers", "DeviceKV", "DeviceRequest", "RestoreChain",
           "RestoreState", "SaveChain", "SaveState"]
