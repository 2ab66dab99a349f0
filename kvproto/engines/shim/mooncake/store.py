"""``mooncake.store`` on kvproto: see :mod:`kvproto.engines.mooncake`."""

from kvproto.engines.mooncake import (  # noqa: F401
    BufferHandle, MooncakeDistributedStore, ReplicateConfig, SoftPinAction)

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction"]
