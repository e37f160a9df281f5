"""Attention backends. Each module registers itself with :mod:`diffattn.attention.registry`
when imported; the registry imports every module of this package on first lookup."""
