"""A protocol prompt as a turn: the request envelope (§5) checked, then made a
:class:`~schemas.Turn` of the agent whose prompt endpoint it came to.

- ``prompt`` is the turn's input: not empty, at most ``[nats_agents] max_input_chars``.
- ``session`` (a top-level field the protocol leaves to the agent, §5.6; the same field
  v0.2 of the protocol defined for a harness's session) names the loopmesh session the
  turn runs in: a caller that sends the same one again continues the conversation.
  Without it each prompt is a conversation of its own, in a new session.
- ``attachments`` become the turn's content parts: an image (by its file name's
  extension) an ``image_url`` part, anything else a ``file`` part, each a ``data:`` URL.
- Any other field is tolerated and ignored (§5.6).

Each refusal is the protocol's ``400``, its description naming the field.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
import time

from synadia_ai.agent_service import RequestRejectedError
from synadia_ai.agents import Attachment, Envelope

from schemas import FilePart, ImagePart, Turn, new_id
from schemas.ids import is_token
from schemas.wire import MAX_PARTS, ContentPart, FileRef, ImageURL

#: The envelope field that names the loopmesh session (§5.6: the protocol leaves it free).
SESSION_FIELD = "session"
#: The longest attachment file name a file part carries.
MAX_FILENAME = 256


def bad(message: str) -> RequestRejectedError:
    """The protocol's ``400`` (§9.2: a malformed request), saying what was wrong."""
    return RequestRejectedError(400, message)


def turn_of(envelope: Envelope, *, agent: str, tenant: str, max_input_chars: int) -> Turn:
    """The turn of ``agent`` a prompt asks for; raises a ``400`` naming the bad field."""
    prompt = envelope.prompt
    if not prompt.strip():
        raise bad("`prompt` is empty: send the text the agent should work on")
    if len(prompt) > max_input_chars:
        raise bad(
            f"`prompt` is {len(prompt)} characters; this endpoint takes at most "
            f"{max_input_chars} ([nats_agents] max_input_chars)"
        )
    attachments = envelope.attachments or []
    if len(attachments) > MAX_PARTS:
        raise bad(f"`attachments` has {len(attachments)} files; a turn takes at most {MAX_PARTS}")
    return Turn(
        id=new_id(),
        tenant=tenant,
        session=session_of(envelope),
        input=prompt,
        created_at=time.time(),
        agent=agent,
        parts=tuple(part_of(i, a) for i, a in enumerate(attachments)),
    )


def session_of(envelope: Envelope) -> str:
    """The session the envelope names, or a new one."""
    session = envelope.extras.get(SESSION_FIELD)
    if session is None:
        return new_id()
    if not isinstance(session, str) or not is_token(session):
        shown = repr(session)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise bad(
            f"`{SESSION_FIELD}` must be 1-64 characters from A-Z a-z 0-9 _ - "
            f"(got {shown}); leave it out for a new conversation"
        )
    return session


def part_of(index: int, attachment: Attachment) -> ContentPart:
    """Attachment ``index`` as a content part: its bytes checked, its type from its name."""
    where = f"`attachments[{index}]`"
    name = attachment.filename
    if not 1 <= len(name) <= MAX_FILENAME:
        raise bad(f"{where}.filename must be 1-{MAX_FILENAME} characters (got {len(name)})")
    try:
        base64.b64decode(attachment.content, validate=True)
    except (binascii.Error, ValueError):
        raise bad(
            f"{where}.content is not standard padded base64 (RFC 4648 §4, no whitespace)"
        ) from None
    media = mimetypes.guess_type(name, strict=False)[0] or "application/octet-stream"
    url = f"data:{media};base64,{attachment.content}"
    if media.startswith("image/"):
        return ImagePart(image_url=ImageURL(url=url))
    return FilePart(file=FileRef(filename=name, file_data=url))
