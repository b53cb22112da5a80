"""Shared test helpers (no tests here): import as ``from helpers.<module> import ...`` (pytest puts ``tests/``
on ``sys.path``)."""
