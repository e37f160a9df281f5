"""The diffattn version, in one place (read by the package root, config files and the CLI)."""

__version__ = "0.1.0"
