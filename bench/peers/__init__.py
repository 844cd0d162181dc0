"""The systems ``python -m bench`` runs, one module each; each is an async context manager
with ``session(sid, k)``: one session of ``k`` echo iterations against the fake LLM."""
