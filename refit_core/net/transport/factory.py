"""The old home of :func:`open_transport` and :func:`resolve_kind`: both now live in the transport registry
(:mod:`refit_core.net.transport.registry`), which opens any registered kind, not only gloo and NCCL."""

from refit_core.net.transport.registry import open_transport, resolve_kind

__all__ = ["open_transport", "resolve_kind"]
