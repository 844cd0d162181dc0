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

    rpm: Count | None = None
    tpm: Count | None = None


class ModelLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[llm.limits.models."<model>"]``: requests and tokens (prompt and reply) per minute
    for a model as requests name it, every worker and tenant together, and each tenant's
    share within it; 0 is no ceiling. They hold over every ``window_s`` (at most
    ``rpm * window_s / 60`` requests in any such window): 60 for a provider that counts
    per minute, less for one that counts over shorter windows (Azure OpenAI: 10)."""

    rpm: Count = 0
    tpm: Count = 0
    tenant_rpm: Count = 0  # each tenant's, within the model's (0: none)
    tenant_tpm: Count = 0
    tenants: dict[Token, TenantLimits] = {}  # one tenant's own, in place of tenant_*
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
    # a request's tokens before it is made: the prompt (counted by the loop) and its
    # reply's ceiling, [llm] max_tokens, or this when that is unset
    reply_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1024
    # a Retry-After longer than this pauses the model this long
    max_pause_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0

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
    base_url: str | None = None  # None: the openai client's default (or OPENAI_BASE_URL)
    api_key: str | None = None
    model: str = "gpt-4o-mini"
    fallback_models: tuple[str, ...] = ()
    timeout_s: Positive = 60.0
    max_retries: Count = 3  # per model, on 429 / 5xx / timeouts / cut streams
    backoff_initial_s: Positive = 0.5
    backoff_max_s: Positive = 8.0
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    seed: Count | None = None  # sampling seed, for endpoints that take one (repeatable replies)
    # llama.cpp's repeat_penalty, sent outside the OpenAI fields when set (None: the
    # server's own; llama-cpp-python's is 1.1)
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0, le=2)] | None = None
    # repeat_penalty for the constrained strategy's second step (a tool's arguments, the
    # answer), whose reply copies values from its prompt (None: as repeat_penalty)
    copy_repeat_penalty: Annotated[float, msgspec.Meta(gt=0, le=2)] | None = None
    fallback_message: str = (
        "I could not reach a language model to answer this. Please try again later."
    )
    limits: LimitSettings = LimitSettings()


class PrefilterSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[loop.prefilter]``: offer the model only the ``top_k`` tools most relevant to the
    request (the loop's own tools always), ranked by embedding similarity from
    ``embeddings_base_url`` (an OpenAI-compatible ``/v1/embeddings``), or by BM25 when
    no endpoint is set or it fails. Off by default."""

    enabled: bool = False
    top_k: Annotated[int, msgspec.Meta(ge=1, le=128)] = 8
    embeddings_base_url: str | None = None  # None: lexical ranking (BM25)
    embeddings_model: str = "text-embedding-3-small"
    embeddings_api_key: str | None = None
    timeout_s: Positive = 10.0  # one embeddings request; past it, BM25 for this call
    query_max_chars: Annotated[int, msgspec.Meta(ge=16)] = 2_000  # of the text ranked against


class BudgetSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[loop.budget]``: ceilings on what a turn, and a tenant in a day (UTC), may spend
    on LLM calls; 0 is no ceiling. Tokens are the model's own count (``usage``), cost is
    from ``[prices]``. A turn whose next call would pass one ends, reason ``budget``."""

    turn_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    turn_cost: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    tenant_daily_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    tenant_daily_cost: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    @property
    def any(self) -> bool:
        return bool(
            self.turn_tokens or self.turn_cost or self.tenant_daily_tokens or self.tenant_daily_cost
        )


class LoopSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_iterations: Annotated[int, msgspec.Meta(ge=1)] = 20
    iteration_warning_at: Count = 3  # warn when this many iterations remain
    tool_format: Literal["native", "text"] = "native"
    instructions: str = ""  # the operator's instructions, first in the system prompt
    context_budget_tokens: Annotated[int, msgspec.Meta(ge=256)] = 16_000
    # kept free in the budget for the model's reply: the prompt gets the rest
    reply_reserve_tokens: Count = 0
    tool_result_max_chars: Annotated[int, msgspec.Meta(ge=100)] = 6_000
    tool_timeout_s: Positive = 60.0
    approval_timeout_s: Positive = 300.0
    circuit_breaker_threshold: Annotated[int, msgspec.Meta(ge=1)] = 3
    empty_response_retries: Count = 2
    max_continuation_nudges: Count = 3
    max_deflection_nudges: Count = 3
    max_no_tool_reminders: Count = 2  # then a reply without tool calls is the answer
    message_max_chars: Annotated[int, msgspec.Meta(ge=100)] = 24_000  # stored replies, events
    summarize_with_llm: bool = True
    prune_target_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.75  # prune down to this
    hooks: tuple[str, ...] = ()  # import paths: "package.module:object"
    # A deployment's search, called with each turn: "package.module:object" (see
    # engine/context.py). What it returns is cut to retrieved_max_tokens.
    retriever: str | None = None
    retrieved_max_tokens: Count = 2_000
    approval_tools: tuple[str, ...] = ()  # "server.tool" names that need a person's approval
    # Per-turn limits: the defaults of the Turn fields of the same names (a turn may
    # set its own). ``tools``: the tools turns may call ("server.tool" or a bare name),
    # None for all; a turn's own list narrows it further, never widens it.
    tools: tuple[str, ...] | None = None
    deadline_s: Positive | None = None  # wall-clock seconds per turn; None: none
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None  # per turn; None: no cap
    max_parallel_tools: Annotated[int, msgspec.Meta(ge=1)] = 8  # per iteration; the rest queue
    tool_failure: Literal["continue", "fail"] = "continue"  # fail: end the turn (tool_failed)
    # The dual-model orchestrator (see orchestrator.py), the default of Turn.mode and
    # its models. A model left None is the turn's model, then [llm] model.
    mode: Literal["loop", "orchestrator"] = "loop"
    planner_model: str | None = None
    executor_model: str | None = None
    plan_max_steps: Annotated[int, msgspec.Meta(ge=1, le=50)] = 8
    step_max_iterations: Annotated[int, msgspec.Meta(ge=1)] = 6  # executor calls per step
    step_retries: Count = 1  # a failed step is tried again this often, then: fallback
    prefilter: PrefilterSettings = PrefilterSettings()
    budget: BudgetSettings = BudgetSettings()
    # "constrained", for small models that pick tools badly: every reply is exactly one
    # tool call, chosen then filled in by two grammar-constrained calls (constrained.py)
    tool_choice_strategy: Literal["auto", "constrained"] = "auto"
    # Agents calling agents (an agent's `agents`): a call waits this long for the
    # called agent's turn, and a chain of calls is at most this deep
    agent_timeout_s: Positive = 600.0
    agent_max_depth: Annotated[int, msgspec.Meta(ge=1, le=16)] = 3
    # A turn that arrives while an earlier turn of its session has not ended (the
    # default of Turn.on_busy): "enqueue" (waits), "reject" (refused), "interrupt" (the
    # earlier turn stops at a safe point) or "rollback" (and its changes are undone)
    on_busy: Literal["enqueue", "reject", "interrupt", "rollback"] = "enqueue"
    # Streamed text (content_delta, thinking_delta) is stored coalesced: a reply's first
    # delta at once, then what streamed in at most every this many milliseconds, and at
    # once before any other event (0: every delta is an event of its own).
    stream_flush_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 50

    def __post_init__(self) -> None:
        if self.context_budget_tokens - self.reply_reserve_tokens < 128:
            raise ValueError(
                f"reply_reserve_tokens ({self.reply_reserve_tokens}) leaves less than 128 of "
                f"context_budget_tokens ({self.context_budget_tokens}) for the prompt; "
                "lower it or raise context_budget_tokens"
            )
