"""Applications built on refit: the ``refit`` command line, benchmarks, the demo, and pictures. Internal."""
