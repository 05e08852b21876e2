"""What plugins and users speak: the hooks, the plugin manager, the data model, settings and errors.

The bottom layer of refit: it imports nothing else of refit's but :mod:`refit_core.units`. Everything a
plugin author or user may use is re-exported by :mod:`refit_core` and :mod:`refit_core.kit`; the
modules here are internal paths.
"""
