"""A protocol prompt made a turn: each field checked, the refusal naming it."""

from __future__ import annotations

import base64

import pytest
from synadia_ai.agent_service import RequestRejectedError
from synadia_ai.agents import Attachment, Envelope

from nats_agents.request import turn_of
from schemas import FilePart, ImagePart, Turn


def made(envelope: Envelope, **kw: int) -> Turn:
    return turn_of(envelope, agent="calc", tenant="acme", max_input_chars=kw.get("limit", 100))


def refusal(envelope: Envelope, **kw: int) -> str:
    with pytest.raises(RequestRejectedError) as raised:
        made(envelope, **kw)
    assert raised.value.code == 400
    return raised.value.description


def test_a_prompt_is_a_turn_of_the_agent_in_the_tenant_in_a_new_session_each_time():
    one, two = made(Envelope(prompt="What is 6 * 7?")), made(Envelope(prompt="Again?"))
    assert (one.agent, one.tenant, one.input) == ("calc", "acme", "What is 6 * 7?")
    assert one.session != two.session and one.id != two.id and one.created_at > 0


def test_a_session_named_in_the_envelope_is_the_turns_and_other_fields_are_ignored():
    turn = made(Envelope(prompt="hi", session="conv-1", x_trace="abc"))
    assert turn.session == "conv-1"


def test_attachments_are_content_parts_by_their_names():
    png = Attachment.from_bytes("chart.png", b"\x89PNG...")
    pdf = Attachment.from_bytes("report.pdf", b"%PDF-1.7")
    blob = Attachment.from_bytes("data.bin-x", b"\x00\x01")
    turn = made(Envelope(prompt="look", attachments=[png, pdf, blob]))
    image, document, other = turn.parts
    assert isinstance(image, ImagePart) and isinstance(document, FilePart)
    assert image.image_url.url == "data:image/png;base64," + png.content
    assert document.file.filename == "report.pdf"
    assert document.file.file_data == "data:application/pdf;base64," + pdf.content
    assert isinstance(other, FilePart)
    assert other.file.file_data == "data:application/octet-stream;base64,AAE="


@pytest.mark.parametrize(
    ("envelope", "said"),
    [
        (Envelope(prompt=""), "`prompt` is empty"),
        (Envelope(prompt=" \n\t"), "`prompt` is empty"),
        (Envelope(prompt="x" * 101), "`prompt` is 101 characters; this endpoint takes at most 100"),
        (Envelope(prompt="hi", session=""), "`session` must be 1-64 characters"),
        (Envelope(prompt="hi", session="a.b"), "(got 'a.b')"),
        (Envelope(prompt="hi", session="s" * 65), "`session` must be 1-64 characters"),
        (Envelope(prompt="hi", session=["s1"]), "(got ['s1'])"),
        (
            Envelope(prompt="hi", attachments=[Attachment(filename="a", content="a b")]),
            "`attachments[0]`.content is not standard padded base64",
        ),
        (
            Envelope(prompt="hi", attachments=[Attachment(filename="", content="AA==")]),
            "`attachments[0]`.filename must be 1-256 characters",
        ),
        (
            Envelope(prompt="hi", attachments=[Attachment(filename="a", content="AA==")] * 17),
            "`attachments` has 17 files; a turn takes at most 16",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_field(envelope: Envelope, said: str):
    assert said in refusal(envelope)


def test_a_long_value_is_shown_cut():
    said = refusal(Envelope(prompt="hi", session="é" * 200))
    assert len(said) < 200 and said.count("é") < 80


def test_base64_must_be_the_standard_alphabet():
    urlsafe = base64.urlsafe_b64encode(b"\xfb\xff").decode()  # "-_8="
    assert "not standard padded base64" in refusal(
        Envelope(prompt="hi", attachments=[Attachment(filename="a", content=urlsafe)])
    )
