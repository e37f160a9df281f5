"""Recipes shipped inside the package (``compare.yaml``: the default of ``diffattn compare``)."""
