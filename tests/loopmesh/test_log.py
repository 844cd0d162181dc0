import io
import json
import logging

import pytest

from loopmesh.log import setup_logging


@pytest.fixture
def stream():
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    buffer = io.StringIO()
    yield buffer
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def test_key_value_lines_carry_the_message_and_extra_fields(stream):
    setup_logging("INFO", stream=stream)
    logging.getLogger("loopmesh.test").info("turn done", extra={"turn_id": "t1", "note": "a b"})
    line = stream.getvalue().strip()
    assert 'level=info logger=loopmesh.test msg="turn done" turn_id=t1 note="a b"' in line
    assert line.startswith("ts=")


def test_json_lines_parse_and_records_below_the_level_are_dropped(stream):
    setup_logging("WARNING", json=True, stream=stream)
    log = logging.getLogger("loopmesh.test")
    log.info("hidden")
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed", extra={"iterations": 3})
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["msg"] == "failed"
    assert record["level"] == "error"
    assert record["iterations"] == 3
    assert "ValueError: bad" in record["exc"]


def test_setting_up_twice_keeps_one_handler(stream):
    setup_logging("INFO", stream=stream)
    setup_logging("INFO", stream=stream)
    logging.getLogger("loopmesh.test").info("once")
    assert stream.getvalue().count("once") == 1


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging("LOUD")


def test_http_clients_do_not_log_a_line_per_request_even_at_info(stream):
    setup_logging("INFO", stream=stream)
    for name in ("httpx", "httpx2", "httpcore"):  # the openai client logs through httpx2
        logging.getLogger(name).info("HTTP Request: POST http://x/v1/chat/completions")
    logging.getLogger("httpx2").warning("a real problem")
    lines = stream.getvalue().strip().splitlines()
    assert len(lines) == 1 and "a real problem" in lines[0]


def test_the_standard_loops_warning_at_each_tls_close_is_dropped(stream):
    """asyncio logs it at every close of a TLS connection to NATS (nats-io/nats.py#727)."""
    setup_logging("INFO", stream=stream)
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.warning("returning true from eof_received() has no effect when using ssl")
    asyncio_log.warning("a real problem")
    lines = stream.getvalue().strip().splitlines()
    assert len(lines) == 1 and "a real problem" in lines[0]
