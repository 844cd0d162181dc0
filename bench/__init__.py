"""Benchmarks: ``python -m bench`` runs loopmesh beside its peers (see ``__main__``)."""
