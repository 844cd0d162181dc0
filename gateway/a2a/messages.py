"""What an A2A message becomes in loopmesh: the session its context names, and the
turn's input.

**Context → session.** An A2A context is a loopmesh session of the caller's tenant. A
context id that is already a loopmesh id (1-64 characters from ``A-Z a-z 0-9 _ -``,
which every id the SDK generates is) *is* the session id, so the context shows under
that name in the web view and ``/v1/sessions``. Any other string (a client may bring its
own: a URN, a path) is mapped to ``ctx-`` and the first 48 hex digits of its SHA-256: the
same context always reaches the same session, and no text of a client's ever becomes
part of a subject. Over :data:`MAX_CONTEXT_ID_CHARS` characters is refused.

**Parts → input.** Text parts are the input, joined by a blank line; a data part
(structured JSON) is added as its JSON text. Images (an http(s) URL or bytes whose media
type is ``image/*``) and files given as bytes go with the turn as content parts
(``Turn.parts``) for models that take them. A file by URL that is not an image is
refused: the model's provider would have to fetch it.
"""

from __future__ import annotations

import base64
import hashlib

import msgspec
from a2a.types import Message, Part
from a2a.utils.errors import InvalidParamsError
from google.protobuf.json_format import MessageToJson

from schemas import ContentPart, is_token
from schemas.wire import MAX_PARTS

MAX_CONTEXT_ID_CHARS = 1_024
SESSION_PREFIX = "ctx-"


def session_of(context_id: str) -> str:
    """The session of an A2A context id (see the module docstring)."""
    if is_token(context_id):
        return context_id
    if not context_id or len(context_id) > MAX_CONTEXT_ID_CHARS:
        raise InvalidParamsError(
            message=f"contextId must be 1-{MAX_CONTEXT_ID_CHARS} characters, not {len(context_id)}"
        )
    return SESSION_PREFIX + hashlib.sha256(context_id.encode()).hexdigest()[:48]


def turn_input(message: Message, max_chars: int) -> tuple[str, tuple[ContentPart, ...]]:
    """The turn's ``input`` and ``parts`` from ``message``; :class:`InvalidParamsError`
    naming the part for one that cannot be passed on."""
    texts: list[str] = []
    parts: list[ContentPart] = []
    for i, part in enumerate(message.parts):
        where = f"message.parts[{i}]"
        match part.WhichOneof("content"):
            case "text":
                texts.append(part.text)
            case "data":
                texts.append(MessageToJson(part.data, indent=None))
            case "url":
                parts.append(_url_part(part, where))
            case "raw":
                parts.append(_raw_part(part, where))
            case _:
                raise InvalidParamsError(message=f"{where} has no content")
    if len(parts) > MAX_PARTS:
        raise InvalidParamsError(
            message=f"at most {MAX_PARTS} image and file parts, not {len(parts)}"
        )
    text = "\n\n".join(t for t in texts if t.strip())
    if not text.strip():
        raise InvalidParamsError(message="the message has no text: send a text part")
    if len(text) > max_chars:
        raise InvalidParamsError(
            message=f"the message's text is {len(text)} characters, over the limit of {max_chars}"
        )
    return text, tuple(parts)


def _url_part(part: Part, where: str) -> ContentPart:
    if not part.media_type.startswith("image/"):
        raise InvalidParamsError(
            message=f"{where}: a file by URL is passed on only as an image (media type "
            f"image/*), not {part.media_type or 'without a media type'}; send its bytes"
        )
    return _convert({"type": "image_url", "image_url": {"url": part.url}}, where)


def _raw_part(part: Part, where: str) -> ContentPart:
    media = part.media_type or "application/octet-stream"
    url = f"data:{media};base64,{base64.b64encode(part.raw).decode('ascii')}"
    if media.startswith("image/"):
        return _convert({"type": "image_url", "image_url": {"url": url}}, where)
    file: dict[str, str] = {"file_data": url}
    if part.filename:
        file["filename"] = part.filename
    return _convert({"type": "file", "file": file}, where)


def _convert(value: dict[str, object], where: str) -> ContentPart:
    try:
        return msgspec.convert(value, ContentPart)
    except (msgspec.ValidationError, ValueError) as exc:
        raise InvalidParamsError(message=f"{where}: {exc}") from None
