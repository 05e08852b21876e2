"""Exceptions raised by refit. Every message names the tensors, ranks or settings at fault."""


class RefitError(RuntimeError):
    """Base class of every error refit raises on purpose."""


class PluginError(RefitError):
    """No installed plugin recognizes a model or backend, or a plugin misbehaved."""


class PlanError(RefitError):
    """The two sides' metadata cannot be matched; raised at setup, before any collective."""


class TransferError(RefitError):
    """A step failed: a peer died, timed out, or sent data for a different plan."""


class WireError(RefitError):
    """A peer sent something that is not well-formed refit data."""


class OptionError(RefitError, ValueError):
    """A setting has a bad value or an unknown name; the message names the class and the field."""


class RendezvousError(RefitError):
    """The rendezvous could not be hosted, reached or trusted: a busy port, a silent or foreign
    listener, a lost connection, a rank that joined twice."""


class AuthenticationError(RendezvousError):
    """A rank of another job, or one with the wrong secret, tried to join (or host) a refit."""
