"""``python -m bench.load``: loopmesh under its users' load (see ``__main__``)."""
