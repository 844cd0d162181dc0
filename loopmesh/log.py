"""Structured logging: one line per record, as ``key=value`` pairs or JSON.

Fields passed with ``extra=`` become keys of their own::

    setup_logging("INFO", json=True)
    log.info("turn done", extra={"turn_id": turn.id, "iterations": 3})
    # {"ts": "...", "level": "info", "logger": "loop_worker", "msg": "turn done",
    #  "turn_id": "...", "iterations": 3}
"""

from __future__ import annotations

import json as _json
import logging
import sys
import time
from typing import Any, TextIO

#: Attributes every LogRecord has; anything else came from ``extra=``.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """A record as an ordered dict: time, level, logger, message, extras, exception."""
    fields: dict[str, Any] = {
        "ts": _timestamp(record.created),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in record.__dict__.items():
        if key not in _STANDARD and not key.startswith("_"):
            fields[key] = value
    if record.exc_info:
        fields["exc"] = logging.Formatter().formatException(record.exc_info)
    return fields


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=info logger=x msg="some text" key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_quote(v)}" for k, v in record_fields(record).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return _json.dumps(record_fields(record), default=str, ensure_ascii=False)


def setup_logging(level: str = "INFO", json: bool = False, *, stream: TextIO | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) in one format. Calling it
    again replaces the handler set up before."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json else KeyValueFormatter())
    handler.set_name("loopmesh")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "loopmesh"]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(_level(level))
    # Libraries that narrate every request at INFO would drown the services' lines.
    # (the openai client logs through ``httpx2``, one line per request.)
    for noisy in ("httpx", "httpx2", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    logging.getLogger("asyncio").addFilter(_tls_eof)  # once: addFilter skips a known one


def _tls_eof(record: logging.LogRecord) -> bool:
    """False for the warning the standard event loop logs at each close of a TLS
    connection to NATS: nats-py's stream protocol answers ``eof_received`` with True,
    which only matters without TLS (nats-io/nats.py#727). uvloop does not log it."""
    return not record.getMessage().startswith("returning true from eof_received()")


def _level(level: str) -> int:
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r} (use DEBUG, INFO, WARNING or ERROR)")
    return value


def _timestamp(created: float) -> str:
    millis = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


def _quote(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    return _json.dumps(text, ensure_ascii=False)
