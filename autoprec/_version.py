"""The package version, in one place every module reads it from (the package itself re-exports it)."""

__version__ = "0.1.0"
