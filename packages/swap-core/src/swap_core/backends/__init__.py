"""Device backends: the only code that touches streams, events, copies and device memory.

Also public, for sibling packages that reason about where tensors' bytes live:
:class:`~swap_core.backends.storage_spans.StorageSpans` and
:func:`~swap_core.backends.dense_storage.is_dense`.
"""

from .dense_storage import is_dense
from .protocol import DeviceBackend, Event, Stream
from .storage_spans import StorageSpans

__all__ = ["DeviceBackend", "Event", "StorageSpans", "Stream", "is_dense"]
