"""The library's version, in a module of its own so that any layer (a checkpoint writer records
it) can read it without importing the package root, which imports every layer."""

__version__ = "0.1.0"
