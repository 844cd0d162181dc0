"""What an A2A message becomes: the session of its context, the turn's input."""

from __future__ import annotations

import pytest
from a2a.types import Message, Part
from a2a.utils.errors import InvalidParamsError
from google.protobuf.struct_pb2 import Value

from gateway.a2a.messages import session_of, turn_input
from schemas import is_token
from schemas.wire import FilePart, ImagePart


def test_a_context_id_that_is_a_loopmesh_id_is_the_session_and_any_other_is_mapped():
    assert session_of("c1") == "c1"
    uuid = "3b6a0d3e-2f1c-4a8e-9d6b-5a4f3c2b1a09"
    assert session_of(uuid) == uuid
    mapped = session_of("urn:conversation:42/a b")
    assert mapped.startswith("ctx-") and is_token(mapped)
    assert session_of("urn:conversation:42/a b") == mapped != session_of("urn:conversation:43")
    with pytest.raises(InvalidParamsError, match="contextId must be 1-1024"):
        session_of("x" * 1025)


def test_text_and_data_parts_are_the_input_and_images_and_files_go_with_it():
    data = Value()
    data.struct_value.update({"n": 2})
    message = Message(parts=[
        Part(text="Look at this"), Part(data=data),
        Part(url="https://example.com/cat.png", media_type="image/png"),
        Part(raw=b"%PDF-1.4", media_type="application/pdf", filename="a.pdf"),
    ])  # fmt: skip
    text, parts = turn_input(message, 1_000)
    assert text == 'Look at this\n\n{"n": 2.0}'
    image, file = parts
    assert isinstance(image, ImagePart) and image.image_url.url == "https://example.com/cat.png"
    assert isinstance(file, FilePart) and file.file.filename == "a.pdf"
    assert file.file.file_data == "data:application/pdf;base64,JVBERi0xLjQ="


def test_a_message_that_makes_no_turn_is_refused_naming_what_is_wrong():
    with pytest.raises(InvalidParamsError, match="no text"):
        turn_input(Message(parts=[Part(text=" ")]), 100)
    with pytest.raises(InvalidParamsError, match="over the limit of 3"):
        turn_input(Message(parts=[Part(text="four")]), 3)
    pdf = Part(url="https://example.com/a.pdf", media_type="application/pdf")
    with pytest.raises(InvalidParamsError, match=r"message.parts\[1\]: a file by URL"):
        turn_input(Message(parts=[Part(text="read"), pdf]), 100)
    bad = Part(url="ftp://example.com/a.png", media_type="image/png")
    with pytest.raises(InvalidParamsError, match=r"message.parts\[1\]"):
        turn_input(Message(parts=[Part(text="see"), bad]), 100)
