"""The package's version, in a module of its own so that any layer may read it without importing
the public API (`exatrain/__init__.py`, which imports every layer)."""

__version__ = "0.1.0"
