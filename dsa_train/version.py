"""The version of dsa_train (as pyproject.toml's), in a module of its own: `dsa_train.__version__`
re-exports it, and the checkpoint tools write it into the marker of what they write without
importing the package's `__init__` (which lazily re-exports the checkpoint package)."""

__version__ = "0.1.0"
