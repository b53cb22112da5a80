"""verl-hpc's version, in a module of its own so that setup.py and `verl --version` read it without importing
the package's API."""

__version__ = "0.1.0"
