"""How ranks talk: the authenticated rendezvous store, its key schema, JSON frames and the transports.

Imports only :mod:`refit_core.contract`. Internal.
"""
