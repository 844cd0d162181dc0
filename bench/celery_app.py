"""The Celery app of ``bench/dispatch.py``: one echo task, Redis as broker and result
backend (``BENCH_REDIS_URL``)."""

from __future__ import annotations

import os

from celery import Celery

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("bench", broker=URL, backend=URL)
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=4, result_expires=300)


@app.task(name="echo")
def echo(text: str) -> str:
    return text
