"""The test suite (a package so that ``tests.environments`` imports without putting ``tests/`` on
``sys.path``, where its folders would shadow missing packages: ``tests/ray`` for ``ray``)."""
