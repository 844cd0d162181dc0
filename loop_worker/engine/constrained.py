"""Constrained tool choice: the ``constrained`` tool-choice strategy, for small models.

A small model (the embedded SmolLM2-135M of ``loopmesh up``) given a long prompt and a
list of tools seldom calls one: it answers in text, or echoes the prompt. With
``[loop] tool_choice_strategy = "constrained"`` every reply is exactly one tool call,
made in two calls to the model, each forced with ``tool_choice`` set to a named
function (grammar-constrained decoding on llama.cpp, vLLM and OpenAI alike):

1. **Choose.** A short few-shot prompt built from the tools' own descriptions
   (``Request: <description>`` / ``Tool: <name>``, the deployment's tools before the
   loop's own, then the user's request) and a
   forced ``choose_tool`` call whose only argument is an enum of the tool names.
   Small models match a request to a description far better this way than by reading
   a tool list in a long prompt. After a tool has run in this turn, the choice is
   ``task_completion``: one tool per turn, then the answer.
2. **Fill in.** A short prompt (the request and this turn's tool results) and a forced
   call of the chosen tool, whose arguments follow its JSON Schema. A URL argument (a
   string property with ``format: uri`` or named ``url``, ``uri``, ``href``, ``link``
   or ``*_url``) is narrowed to an ``enum`` of the URLs the request spells out, when it
   has any (:func:`pin_urls`): a small model copying a URL token by token drops or
   changes parts of it (``http://`` becomes ``https://``), and the grammar that
   llama.cpp and others build from the schema then lets it write only those.
   A call cut by the reply's token limit inside a string (a small model that repeats
   itself does this to its answer) is closed (:func:`closed`), so it keeps what it wrote,
   up to where it began to repeat itself.
   This step may go to an LLM of its own (``copying``): the embedded demo model's has
   no repeat penalty, which would make it change the values it copies.

The results a step-2 prompt shows are made plain for a small model
(:func:`readable`): a JSON object as ``key: value`` lines, markup (HTML) as its text.

Replies without tools (the forced summary, memory summaries) go through unchanged.
:class:`ConstrainedLLM` wraps any LLM whose ``complete`` takes ``tool_choice`` (such as
:class:`~loop_worker.engine.llm.OpenAILLM`) and is an :class:`~.protocols.LLM` itself,
so the engine does not know it is there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from html.parser import HTMLParser
from typing import Any, Protocol

import msgspec

from schemas import ChatMessage, ToolCall

from .prompt import LOOP_NAME, load_prompts
from .protocols import Completion, OnDelta, OnRetry

#: The function of step 1; its ``tool`` argument is one of the offered names.
CHOOSE = "choose_tool"
#: The loop tool that answers, chosen once a tool has run in this turn.
ANSWER = "task_completion"
#: The loop's own tools (server ``loop``), offered after the deployment's.
LOOP = frozenset({"task_completion", "ask_question", "converse", "update_plan"})
#: Loop tools never chosen: a plan needs replies of several steps.
NOT_CHOSEN = frozenset({"update_plan"})
#: Characters of one tool result shown to the model in step 2.
RESULT_MAX_CHARS = 1500

ARGUMENTS_SYSTEM = "Call the tool with the arguments the request gives. Copy values exactly."
ANSWER_SYSTEM = "Answer the user with the tool's result."


class ChoosingLLM(Protocol):
    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] = (),
        model: str | None = None,
        on_delta: OnDelta | None = None,
        on_retry: OnRetry | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> Completion: ...


class ConstrainedLLM:
    """An :class:`~.protocols.LLM` whose every reply with tools offered is one tool call."""

    def __init__(self, inner: ChoosingLLM, *, copying: ChoosingLLM | None = None) -> None:
        self.inner = inner
        #: step 2's LLM (``inner`` unless given): its reply copies values from its prompt
        self.copying = copying or inner

    async def aclose(self) -> None:
        """Close the inner LLMs, if they close. Idempotent when their ``aclose`` is."""
        for llm in dict.fromkeys((self.inner, self.copying)):
            aclose = getattr(llm, "aclose", None)
            if aclose is not None:
                await aclose()

    async def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[dict[str, Any]] = (),
        model: str | None = None,
        on_delta: OnDelta | None = None,
        on_retry: OnRetry | None = None,
    ) -> Completion:
        functions = {t["function"]["name"]: t for t in tools if t.get("type") == "function"}
        if not functions:
            return await self.inner.complete(
                messages, model=model, on_delta=on_delta, on_retry=on_retry
            )
        turn = TurnView.of(messages)
        chosen, latency = await self._choose(turn, functions, model, on_retry)
        spec = pin_urls(functions[chosen], urls_in(turn.request))
        system = ANSWER_SYSTEM if chosen == ANSWER else ARGUMENTS_SYSTEM
        prompt = [
            ChatMessage(role="system", content=system),
            ChatMessage(role="user", content=turn.brief()),
        ]
        completion = await self.copying.complete(
            prompt,
            tools=[spec],
            model=model,
            on_retry=on_retry,
            tool_choice=_named(chosen),
        )
        calls = tuple(closed(c) for c in completion.tool_calls[:1]) or (
            ToolCall(id="call_0", name=chosen, arguments="{}"),
        )
        return msgspec.structs.replace(
            completion,
            content="",
            tool_calls=calls,
            latency_ms=completion.latency_ms + latency,
        )

    async def _choose(
        self,
        turn: TurnView,
        functions: dict[str, dict[str, Any]],
        model: str | None,
        on_retry: OnRetry | None,
    ) -> tuple[str, float]:
        """Step 1: the name of the function to call, and the time it took (ms)."""
        if turn.results and ANSWER in functions:
            return ANSWER, 0.0
        # the deployment's tools first, the loop's own last (small models favour the first)
        names = sorted((n for n in functions if n not in NOT_CHOSEN), key=lambda n: n in LOOP)
        labels = _labels(names or list(functions))
        if len(labels) == 1:
            return next(iter(labels.values())), 0.0
        shots = [
            f"Request: {_one_line(functions[name]['function'].get('description', ''))}\n"
            f"Tool: {label}\n"
            for label, name in labels.items()
        ]
        prompt = "\n".join([*shots, f"Request: {_one_line(turn.request)}\nTool:"])
        choose = {
            "type": "function",
            "function": {
                "name": CHOOSE,
                "description": "The tool to call next",
                "parameters": {
                    "type": "object",
                    "properties": {"tool": {"type": "string", "enum": list(labels)}},
                    "required": ["tool"],
                },
            },
        }
        completion = await self.inner.complete(
            [ChatMessage(role="user", content=prompt)],
            tools=[choose],
            model=model,
            on_retry=on_retry,
            tool_choice=_named(CHOOSE),
        )
        label = _chosen_label(completion, labels)
        return labels.get(label, ANSWER if ANSWER in functions else next(iter(functions))), (
            completion.latency_ms
        )


class TurnView(msgspec.Struct, frozen=True, kw_only=True):
    """What the two steps read of the engine's prompt: the user's request and the
    results of the tools this turn called so far, as (function name, text)."""

    request: str
    results: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, messages: Sequence[ChatMessage]) -> TurnView:
        heading = load_prompts().turn.input_heading
        at = max(
            (i for i, m in enumerate(messages) if m.role == "user" and m.name != LOOP_NAME),
            default=-1,
        )
        if at < 0:
            return cls(request="")
        content = messages[at].content
        request = content.rsplit(heading, 1)[1] if heading in content else content
        names: dict[str, str] = {}
        results: list[tuple[str, str]] = []
        for m in messages[at + 1 :]:
            for call in m.tool_calls:
                names[call.id] = call.name
            if m.role == "tool":
                results.append((names.get(m.tool_call_id or "", "tool"), m.content))
        return cls(request=request.strip(), results=tuple(results))

    def brief(self) -> str:
        """Step 2's user message: the request, then each result."""
        parts = [self.request]
        for name, text in self.results:
            text = readable(text)
            text = text if len(text) <= RESULT_MAX_CHARS else text[:RESULT_MAX_CHARS] + "…"
            parts.append(f"{_label(name)} says: {text}")
        return "\n\n".join(parts)


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _label(name: str) -> str:
    """``local__calculator`` → ``calculator``: the tool's own name reads better."""
    return name.rsplit("__", 1)[-1]


def _labels(names: Sequence[str]) -> dict[str, str]:
    """Short labels for the names, by label; a label two names share stays whole."""
    short = [_label(n) for n in names]
    return {(s if short.count(s) == 1 else n): n for s, n in zip(short, names, strict=True)}


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _chosen_label(completion: Completion, labels: dict[str, str]) -> str:
    for call in completion.tool_calls[:1]:
        try:
            value = msgspec.json.decode(call.arguments or "{}")
        except msgspec.DecodeError:
            return ""
        if isinstance(value, dict) and isinstance(value.get("tool"), str):
            return str(value["tool"])
    return ""


# -- URL arguments ------------------------------------------------------------------------

#: A URL as written in a request: a scheme, ``://``, then anything up to a space, a
#: quote or a bracket (a sentence's closing punctuation is taken off after).
_URL = re.compile(r"""\b[A-Za-z][A-Za-z0-9+.-]*://[^\s<>"'`]+""")
_URL_NAMES = frozenset({"url", "uri", "href", "link"})
_URL_FORMATS = frozenset({"uri", "url", "iri", "uri-reference", "iri-reference"})


def urls_in(text: str) -> list[str]:
    """The URLs in ``text``, in order, each once."""
    found = (m.group().rstrip(".,;:!?)]}'\"") for m in _URL.finditer(text))
    return list(dict.fromkeys(u for u in found if not u.endswith("://")))


def is_url_property(name: str, schema: Any) -> bool:
    """Whether the argument ``name`` with JSON Schema ``schema`` takes a URL."""
    if not isinstance(schema, dict):
        return False
    lowered = name.lower()
    named = lowered in _URL_NAMES or lowered.endswith(("_url", "_uri"))
    return schema.get("format") in _URL_FORMATS or named


def pin_urls(spec: dict[str, Any], urls: Sequence[str]) -> dict[str, Any]:
    """``spec`` (a ``tools`` entry) with each string URL argument limited to ``urls``
    (its alternatives of type string, in an ``anyOf``); unchanged when ``urls`` is
    empty or it takes no URL."""
    parameters = spec.get("function", {}).get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not urls or not isinstance(properties, dict):
        return spec
    pinned = {
        name: _pinned(schema, urls) if is_url_property(name, schema) else schema
        for name, schema in properties.items()
    }
    if pinned == properties:
        return spec
    assert isinstance(parameters, dict)
    function = {**spec["function"], "parameters": {**parameters, "properties": pinned}}
    return {**spec, "function": function}


def _pinned(schema: dict[str, Any], urls: Sequence[str]) -> dict[str, Any]:
    if schema.get("type") == "string" and "enum" not in schema:
        return {**schema, "enum": list(urls)}
    alternatives = schema.get("anyOf")
    if isinstance(alternatives, list):
        return {
            **schema,
            "anyOf": [_pinned(a, urls) if isinstance(a, dict) else a for a in alternatives],
        }
    return schema


def closed(call: ToolCall) -> ToolCall:
    """``call`` with its arguments closed when they were cut inside a string or an
    object (``{"result": "The code is 4417. The code is``); as it is otherwise.

    A reply cut by the token limit has usually been looping: the texts of a closed call
    are cut back to where they began to repeat themselves (:func:`unrepeated`)."""
    try:
        msgspec.json.decode(call.arguments or "{}")
        return call
    except msgspec.DecodeError:
        pass
    for end in ('"}', "}"):
        try:
            value = msgspec.json.decode(call.arguments + end)
        except msgspec.DecodeError:
            continue
        if isinstance(value, dict):
            arguments = call.arguments + end
            cut = {k: unrepeated(v) if isinstance(v, str) else v for k, v in value.items()}
            if cut != value:
                arguments = msgspec.json.encode(cut).decode()
            return msgspec.structs.replace(call, arguments=arguments)
    return call


#: A sentence: up to its end mark or line end, with the space after it.
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|\n|$)\s*|\s+")
#: How many of the last sentences a repeat is looked for among (a loop of up to three).
_LOOP = 3
#: A sentence that begins with the same words as a recent one starts the loop again.
_OPENING_WORDS = 3


def unrepeated(text: str) -> str:
    """``text`` up to the first sentence that repeats one of the few before it, or
    begins with the same three words; a cut-off last sentence that begins one of them
    goes too. A small model looping at its token limit varies what it repeats, and the
    variations are false: ``"The code is 4417. The code is 2018. The code is 4417. The"``
    is ``"The code is 4417."``. A text that does not repeat itself is returned as it is."""
    sentences = _SENTENCE.findall(text)
    kept: list[str] = []
    for i, sentence in enumerate(sentences):
        said = sentence.strip()
        cut_off = i == len(sentences) - 1 and not said.endswith((".", "!", "?"))
        if said and any(
            said == before or _same_opening(said, before) or (cut_off and before.startswith(said))
            for before in (s.strip() for s in kept[-_LOOP:])
        ):
            return "".join(kept).rstrip()
        kept.append(sentence)
    return text


def _opening(sentence: str) -> tuple[str, ...] | None:
    """The first words of a sentence long enough to have more (None: too short)."""
    words = sentence.casefold().split()
    return tuple(words[:_OPENING_WORDS]) if len(words) > _OPENING_WORDS else None


def _same_opening(a: str, b: str) -> bool:
    """Whether two sentences of more than three words begin with the same three."""
    opening = _opening(a)
    return opening is not None and opening == _opening(b)


# -- results, made plain -------------------------------------------------------------------

_MARKUP = re.compile(r"<(?:!DOCTYPE|html|body|head|div|p|h[1-6]|span|br|a|ul|li|table)\b", re.I)


def readable(text: str) -> str:
    """A tool result as a small model reads it best: a JSON object as ``key: value``
    lines (strings unquoted), and HTML as its text; anything else as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict) and value:
        lines = [
            f"{key}: {plain(item) if isinstance(item, str) else json.dumps(item)}"
            for key, item in value.items()
        ]
        return "\n".join(lines)
    return plain(text)


def plain(text: str) -> str:
    """``text``'s words without its markup when it is HTML."""
    if not _MARKUP.search(text):
        return text
    parser = _Text()
    try:
        parser.feed(text)
        parser.close()
    except Exception:  # not markup after all: as it is
        return text
    return " ".join(" ".join(parser.parts).split())


class _Text(HTMLParser):
    """The text of an HTML document, without its scripts and styles."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)
