"""One module per ``diffattn`` verb, each with ``add_arguments(parser)`` and ``run(args)``.

``diffattn.cli`` wires them together; the library modules they call never import from here.
"""
