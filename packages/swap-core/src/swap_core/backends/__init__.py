"""Device backends: the only code that touches streams, events, copies and device memory."""

from .protocol import DeviceBackend, Event, Stream

__all__ = ["DeviceBackend", "Event", "Stream"]
