"""Settings of the loop worker: the LLM endpoint and the loop's limits.

Read once at start by ``loopmesh.settings.load`` from the ``[llm]`` and ``[loop]``
tables of the TOML file and ``LOOPMESH_LLM__*`` / ``LOOPMESH_LOOP__*`` variables.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas import Token

Positive = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class TenantLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tenant's own ceilings within a model (``[llm.limits.models."<model>".tenants.<t>]``):
    they replace the model's ``tenant_rpm`` / ``tenant_tpm`` for it (unset: those; 0: none)."""

    #: The tenant's requests per minute of this model (unset: the model's ``tenant_rpm``).
    rpm: Count | None = None
    #: The tenant's tokens per minute of this model (unset: the model's ``tenant_tpm``).
    tpm: Count | None = None


class ModelLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[llm.limits.models."<model>"]``: requests and tokens (prompt and reply) per minute
    for a model as requests name it, every worker and tenant together, and each tenant's
    share within it; 0 is no ceiling. They hold over every ``window_s`` (at most
    ``rpm * window_s / 60`` requests in any such window): 60 for a provider that counts
    per minute, less for one that counts over shorter windows (Azure OpenAI: 10)."""

    #: Requests per minute to the model, all workers and tenants together (0: none).
    rpm: Count = 0
    #: Tokens per minute (prompt and reply ceiling, corrected by the reply's usage).
    tpm: Count = 0
    #: Each tenant's requests per minute, within the model's (0: none).
    tenant_rpm: Count = 0
    #: Each tenant's tokens per minute, within the model's (0: none).
    tenant_tpm: Count = 0
    #: One tenant's own ceilings, in place of ``tenant_rpm`` / ``tenant_tpm``.
    tenants: dict[Token, TenantLimits] = {}
    #: The window the ceilings hold over: 60 for a provider that counts per minute.
    window_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0

    def tenant(self, tenant: str) -> tuple[int, int]:
        """``tenant``'s own (rpm, tpm) within the model; 0: none."""
        own = self.tenants.get(tenant)
        if own is None:
            return self.tenant_rpm, self.tenant_tpm
        rpm = self.tenant_rpm if own.rpm is None else own.rpm
        tpm = self.tenant_tpm if own.tpm is None else own.tpm
        return rpm, tpm

    def per_window(self, per_minute: int) -> int:
        """What ``per_minute`` allows in one ``window_s`` (0: no ceiling)."""
        return int(per_minute * self.window_s / 60) if per_minute else 0


class LimitSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[llm.limits]``: rate limits that every loop worker shares through NATS
    (docs/ARCHITECTURE.md, "Fleet-wide LLM rate limits"). A model not in ``models``
    has none; a provider's 429 with ``Retry-After`` pauses any model for every worker."""

    models: dict[str, ModelLimits] = {}
    #: A request counts its prompt (counted by the loop) and its reply's ceiling before
    #: it is made: ``[llm] max_tokens``, or this when that is unset.
    reply_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1024
    #: A provider's ``Retry-After`` longer than this pauses the model this long.
    max_pause_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    #: A call to a model with limits waits at most this long for any rate-limit leader
    #: to answer (none elected, the limits bucket down); a leader's "still waiting"
    #: starts it again, so a call queued behind the limit is not cut short.
    leader_wait_s: Annotated[float, msgspec.Meta(ge=1, le=3600)] = 30.0
    #: What such a call does then: ``"fail"`` (fail closed: it fails with
    #: ``LimiterUnavailableError`` and its turn ends ``llm_failed``) or ``"allow"``
    #: (fail open: it goes to the provider uncounted).
    no_leader: Literal["fail", "allow"] = "fail"

    def __post_init__(self) -> None:
        for model, limits in self.models.items():
            _check_model(model, limits)


def _check_model(model: str, m: ModelLimits) -> None:
    """A ValueError naming the field (``models."<model>".<field>``) of a model's limits
    that cannot work: none set, less than one per window, a tenant's above the model's."""
    where = f"models.{_quoted(model)}"
    if not model.strip():
        raise ValueError("`models`: a model name is empty")
    if not (m.rpm or m.tpm or m.tenant_rpm or m.tenant_tpm or m.tenants):
        raise ValueError(
            f"`{where}` sets no limit: set rpm, tpm, tenant_rpm, tenant_tpm or tenants, "
            "or leave the model out"
        )
    ceilings: list[tuple[str, int, int]] = [
        ("rpm", m.rpm, m.rpm),
        ("tpm", m.tpm, m.tpm),
        ("tenant_rpm", m.tenant_rpm, m.rpm),
        ("tenant_tpm", m.tenant_tpm, m.tpm),
    ]
    for tenant, own in m.tenants.items():
        for field, value, model_value in (("rpm", own.rpm, m.rpm), ("tpm", own.tpm, m.tpm)):
            if value is not None:
                ceilings.append((f"tenants.{tenant}.{field}", value, model_value))
    for field, value, model_value in ceilings:
        if value and m.per_window(value) < 1:
            raise ValueError(
                f"`{where}.{field}` ({value}) allows less than one per window_s "
                f"({m.window_s:g} s): raise it or widen window_s"
            )
        if value and model_value and value > model_value and field not in ("rpm", "tpm"):
            kind = field.rsplit(".", 1)[-1].removeprefix("tenant_")
            raise ValueError(
                f"`{where}.{field}` ({value}) is above the model's {kind} ({model_value}): "
                "a tenant's share is within the model's"
            )


def _quoted(key: str) -> str:
    """A TOML key as written in the file: bare when it can be, else quoted."""
    return key if key.replace("-", "").replace("_", "").isalnum() else f'"{key}"'


class LLMSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[llm]``: the OpenAI-compatible endpoint the loop workers call, and how."""

    #: The endpoint's base URL, ``.../v1`` (unset: the openai client's default, or
    #: ``OPENAI_BASE_URL``).
    base_url: str | None = None
    #: The endpoint's API key (unset: the placeholder ``not-needed`` is sent, for an
    #: endpoint that takes none).
    api_key: str | None = None
    #: The model of a turn that names none (and whose agent names none).
    model: str = "gpt-4o-mini"
    #: Tried in order when the model fails (its retries spent, or a client error).
    fallback_models: tuple[str, ...] = ()
    #: One request's limit.
    timeout_s: Positive = 60.0
    #: The HTTP client under the ``openai`` client: ``lean``, loopmesh's HTTP/1.1
    #: transport (``loop_worker/engine/http1.py``: a fraction of the CPU per streamed
    #: chunk, ``python -m bench.stream_parse``); ``httpx``, the client's own.
    http: Literal["lean", "httpx"] = "lean"
    #: Retries per model on a 429, a 5xx, a timeout, a connection error or a cut stream.
    max_retries: Count = 3
    #: The first retry's wait ceiling (full jitter); it doubles each retry.
    backoff_initial_s: Positive = 0.5
    #: The longest wait between retries, ``Retry-After`` included.
    backoff_max_s: Positive = 8.0
    #: The sampling temperature sent (unset: the endpoint's own).
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    #: The reply's token ceiling sent (unset: the endpoint's own).
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: The sampling seed, for endpoints that take one (repeatable replies).
    seed: Count | None = None
    #: llama.cpp's ``repeat_penalty``, sent outside the OpenAI fields when set (unset:
    #: the server's own; llama-cpp-python's is 1.1).
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0, le=2)] | None = None
    #: ``repeat_penalty`` for the constrained strategy's second step (a tool's
    #: arguments, the answer), whose reply copies values from its prompt (unset: as
    #: ``repeat_penalty``).
    copy_repeat_penalty: Annotated[float, msgspec.Meta(gt=0, le=2)] | None = None
    #: The answer of a turn whose every model failed (``loop_end`` reason ``llm_failed``).
    fallback_message: str = (
        "I could not reach a language model to answer this. Please try again later."
    )
    limits: LimitSettings = LimitSettings()


class PrefilterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[loop.prefilter]``: offer the model only the ``top_k`` tools most relevant to the
    request (the loop's own tools always), ranked by embedding similarity from
    ``embeddings_base_url`` (an OpenAI-compatible ``/v1/embeddings``), or by BM25 when
    no endpoint is set or it fails. Off by default."""

    #: Rank the tools (off: every tool of the catalog is offered).
    enabled: bool = False
    #: Tools offered besides the loop's own (``task_completion`` and the rest).
    top_k: Annotated[int, msgspec.Meta(ge=1, le=128)] = 8
    #: An OpenAI-compatible ``/v1/embeddings`` base URL (unset: BM25).
    embeddings_base_url: str | None = None
    #: The embeddings model.
    embeddings_model: str = "text-embedding-3-small"
    #: The embeddings endpoint's API key.
    embeddings_api_key: str | None = None
    #: One embeddings request's limit; past it, BM25 for this call.
    timeout_s: Positive = 10.0
    #: The most characters of the request (and plan step) ranked against.
    query_max_chars: Annotated[int, msgspec.Meta(ge=16)] = 2_000


class BudgetSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[loop.budget]``: ceilings on what a turn, and a tenant in a day (UTC), may spend
    on LLM calls; 0 is no ceiling. Tokens are the model's own count (``usage``), cost is
    from ``[prices]``. A turn whose next call would pass one ends, reason ``budget``."""

    #: Tokens one turn may spend (0: none).
    turn_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: Cost one turn may spend, in the unit of ``[prices]`` (0: none).
    turn_cost: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: Tokens a tenant may spend in a UTC day (0: none).
    tenant_daily_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: Cost a tenant may spend in a UTC day (0: none).
    tenant_daily_cost: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    @property
    def any(self) -> bool:
        return bool(
            self.turn_tokens or self.turn_cost or self.tenant_daily_tokens or self.tenant_daily_cost
        )


MemoryMode = Literal["off", "tools", "auto"]


class MemorySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[loop.memory]``: a memory that outlives a session, per tenant, kept in JetStream.
    ``tools`` offers the model ``memory.save``, ``memory.search`` and ``memory.forget``;
    ``auto`` also recalls the memories nearest a turn's input into the prompt's
    retrieved-context section. A memory belongs to the turn's user (``Turn.user``) or,
    without one, to the agent. Embeddings come from ``embeddings_base_url`` (an
    OpenAI-compatible ``/v1/embeddings``), else from the bundled MiniLM, run in process
    (the ``memory`` extra). An agent's ``memory`` sets the mode for its turns."""

    #: ``off``, ``tools`` or ``auto`` (see above).
    mode: MemoryMode = "off"
    #: Memories recalled into the prompt in ``auto`` mode, nearest first.
    recall: Annotated[int, msgspec.Meta(ge=0, le=32)] = 3
    #: The least cosine similarity of a recalled memory (and of a search's results).
    min_score: Annotated[float, msgspec.Meta(ge=-1, le=1)] = 0.2
    #: The most memories a namespace (one user's, one agent's) holds; a save past it fails.
    max_per_namespace: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 10_000
    #: An OpenAI-compatible ``/v1/embeddings`` base URL (unset: the bundled MiniLM).
    embeddings_base_url: str | None = None
    #: The embeddings model at ``embeddings_base_url``.
    embeddings_model: str = "text-embedding-3-small"
    #: The embeddings endpoint's API key.
    embeddings_api_key: str | None = None
    #: One embeddings request's limit.
    timeout_s: Positive = 10.0


class LoopSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[loop]``: how the loop workers run a turn, and the defaults of a turn's limits
    (a turn, or its agent, may set its own)."""

    #: LLM calls per turn (the orchestrator's plan, steps and synthesis too); then the
    #: turn ends, reason ``max_iterations``.
    max_iterations: Annotated[int, msgspec.Meta(ge=1)] = 20
    #: The prompt warns the model when this many iterations remain.
    iteration_warning_at: Count = 3
    #: ``native`` (the API's function calling) or ``text`` (tool calls written in the
    #: reply, for models without function calling).
    tool_format: Literal["native", "text"] = "native"
    #: The operator's instructions, first in the system prompt.
    instructions: str = ""
    #: The tokens a prompt may take; past it older messages are pruned (and summarised).
    context_budget_tokens: Annotated[int, msgspec.Meta(ge=256)] = 16_000
    #: Kept free in the budget for the model's reply: the prompt gets the rest.
    reply_reserve_tokens: Count = 0
    #: A tool result is cut to this many characters for the model.
    tool_result_max_chars: Annotated[int, msgspec.Meta(ge=100)] = 6_000
    #: A tool call's timeout at most (a tool's own shorter one wins); then ``tool_timeout``.
    tool_timeout_s: Positive = 60.0
    #: A call waiting for a person is refused when no decision came within this.
    approval_timeout_s: Positive = 300.0
    #: The same error of the same tool this many times ends the turn, ``circuit_open``.
    circuit_breaker_threshold: Annotated[int, msgspec.Meta(ge=1)] = 3
    #: An empty reply is asked for again this often; then the model is asked for its
    #: final answer without tools (``loop_end`` reason ``forced_summary``).
    empty_response_retries: Count = 2
    #: A reply that looks unfinished is sent back with a nudge to go on, at most this often.
    max_continuation_nudges: Count = 3
    #: A reply that says it cannot do the task is sent back with a nudge to try the
    #: tools, at most this often.
    max_deflection_nudges: Count = 3
    #: A reply without tool calls is sent back with a reminder to call one, at most this
    #: often; then such a reply is the answer.
    max_no_tool_reminders: Count = 2
    #: Replies, thinking and messages are stored (and sent in events) cut to this.
    message_max_chars: Annotated[int, msgspec.Meta(ge=100)] = 24_000
    #: Pruned messages are summarised by the model (off: a summary made without it).
    summarize_with_llm: bool = True
    #: A prompt over budget is pruned down to this share of it.
    prune_target_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.75
    #: Hook objects plugged into the loop, by import path ``package.module:object``
    #: (loop_worker/engine/hooks.py).
    hooks: tuple[str, ...] = ()
    #: A deployment's search, called with each turn: ``package.module:object``
    #: (loop_worker/engine/context.py); its passages go in the prompt.
    retriever: str | None = None
    #: What the retriever returns is cut to this many tokens.
    retrieved_max_tokens: Count = 2_000
    #: Tools whose calls wait for a person's approval: ``server.tool`` or the function
    #: name (``local__fs_write``). A name that matches no tool makes every call wait.
    approval_tools: tuple[str, ...] = ()
    #: The tools turns may call (``server.tool`` or a bare name; unset: all); a turn's
    #: own list narrows it, never widens it.
    tools: tuple[str, ...] | None = None
    #: Wall-clock seconds per turn (unset: none); then the turn ends, reason ``deadline``.
    deadline_s: Positive | None = None
    #: Tool calls per turn (unset: no cap); calls past it are refused, ``max_tool_calls``.
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: Calls of one iteration run at once; the rest queue.
    max_parallel_tools: Annotated[int, msgspec.Meta(ge=1)] = 8
    #: ``fail``: the first failed tool call ends the turn, reason ``tool_failed``.
    tool_failure: Literal["continue", "fail"] = "continue"
    #: ``orchestrator``: a planner plans without tools, an executor runs each step with
    #: them, the planner writes the answer (loop_worker/engine/orchestrator.py).
    mode: Literal["loop", "orchestrator"] = "loop"
    #: The orchestrator's planner (unset: the turn's model, then ``[llm] model``).
    planner_model: str | None = None
    #: The orchestrator's executor (unset: the turn's model, then ``[llm] model``).
    executor_model: str | None = None
    #: The most steps of a plan.
    plan_max_steps: Annotated[int, msgspec.Meta(ge=1, le=50)] = 8
    #: Executor calls per step before the step has failed.
    step_max_iterations: Annotated[int, msgspec.Meta(ge=1)] = 6
    #: A failed step is tried again this often; then the single-model loop takes over.
    step_retries: Count = 1
    prefilter: PrefilterSettings = PrefilterSettings()
    budget: BudgetSettings = BudgetSettings()
    memory: MemorySettings = MemorySettings()
    #: ``constrained``, for small models that pick tools badly: every reply is exactly
    #: one tool call, chosen then filled in by two grammar-constrained calls.
    tool_choice_strategy: Literal["auto", "constrained"] = "auto"
    #: A call of another agent waits this long for the called agent's turn.
    agent_timeout_s: Positive = 600.0
    #: The longest chain of agents calling agents.
    agent_max_depth: Annotated[int, msgspec.Meta(ge=1, le=16)] = 3
    #: A turn that arrives while an earlier turn of its session runs: ``enqueue``
    #: (waits), ``reject`` (refused), ``interrupt`` (the earlier turn stops at a safe
    #: point) or ``rollback`` (and its changes are undone).
    on_busy: Literal["enqueue", "reject", "interrupt", "rollback"] = "enqueue"
    #: Streamed text is stored coalesced: a reply's first delta at once, then at most
    #: one delta every this many milliseconds, and at once before any other event (0:
    #: every delta is an event).
    stream_flush_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 50

    def __post_init__(self) -> None:
        if self.context_budget_tokens - self.reply_reserve_tokens < 128:
            raise ValueError(
                f"reply_reserve_tokens ({self.reply_reserve_tokens}) leaves less than 128 of "
                f"context_budget_tokens ({self.context_budget_tokens}) for the prompt; "
                "lower it or raise context_budget_tokens"
            )
