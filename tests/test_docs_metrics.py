"""docs/OBSERVABILITY.md's metric tables are the metrics the code registers, both ways:
each metric's name, type and labels, and the values of a label where the doc lists them.

The code's metrics are read from the source: every ``Counter(...)``, ``Gauge(...)``,
``Histogram(...)`` and ``Summary(...)`` call with a literal name, in every package."""

from __future__ import annotations

import ast
import functools
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from schemas.wire import ToolStatus
from webhooks.delivery import Failure

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "OBSERVABILITY.md"
PACKAGES = ("loopmesh", "loop_worker", "tool_worker", "gateway", "webhooks", "nats_agents")
EXPORTER = "loopmesh/exporter.py"
KINDS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary"}


@dataclass(frozen=True)
class Metric:
    name: str  # as scraped: a counter's with `_total`
    kind: str
    labels: tuple[str, ...]


def sources() -> Iterator[tuple[Path, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text())


@functools.cache
def registered() -> dict[str, Metric]:
    """Every metric the code makes, by name."""
    found = {}
    for path, tree in sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            kind = KINDS.get(node.func.id)
            if kind is None or not node.args or not _is_str(node.args[0]):
                continue
            name = node.args[0].value  # type: ignore[attr-defined]
            labels = node.args[2] if len(node.args) > 2 else None
            for keyword in node.keywords:
                if keyword.arg == "labelnames":
                    labels = keyword.value
            names = tuple(_strings(labels)) if labels is not None else ()
            full = name + "_total" if kind == "counter" else name
            assert full not in found, f"{full} is made twice ({path})"
            found[full] = Metric(full, kind, names)
    return found


def _is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _strings(node: ast.AST | None) -> list[str]:
    """The string constants in ``node``, in order."""
    if node is None:
        return []
    return [n.value for n in ast.walk(node) if _is_str(n)]  # type: ignore[attr-defined]


# -- the doc ---------------------------------------------------------------------------------

_ROW = re.compile(r"^\| `(\w+)` \| (\w+) \|([^|]*)\|", re.MULTILINE)
#: A label, and its values when a parenthesis of code spans only follows it.
_LABEL = re.compile(r"`(\w+)`(?: \(((?:`[\w.-]+`(?:, )?)+)\))?")


@functools.cache
def documented() -> tuple[dict[str, Metric], dict[tuple[str, str], set[str]]]:
    """The metrics of the doc's tables, and the label values it lists."""
    text = DOC.read_text()
    section = text[text.index("## Every metric") : text.index("## Grafana dashboards")]
    metrics, values = {}, {}
    for name, kind, cell in _ROW.findall(section):
        labels = []
        for label, listed in _LABEL.findall(_without_prose(cell)):
            labels.append(label)
            if listed:
                values[(name, label)] = set(re.findall(r"`([\w.-]+)`", listed))
        assert name not in metrics, f"{name} is listed twice"
        metrics[name] = Metric(name, kind, tuple(labels))
    return metrics, values


def _without_prose(cell: str) -> str:
    """A labels cell less its parentheses that are words, not a list of values:
    ``outcome (the `loop_end` reason)`` names the label ``outcome`` only."""
    return re.sub(r" \((?!`)[^)]*\)", "", cell)


# -- where the code's label values come from --------------------------------------------------


def assigned(path: str, name: str) -> set[str]:
    """The strings ``name`` is set to in module ``path`` (``outcome = "acked"``)."""
    tree = ast.parse((ROOT / path).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (
                    zip(target.elts, node.value.elts, strict=False)
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                    else [(target, node.value)]
                )
                for t, v in pairs:
                    if isinstance(t, ast.Name) and t.id == name:
                        found.update(_strings(v))
    return found


def label_calls(path: str, metric: str) -> set[str]:
    """The strings given to ``<metric>.labels(...)`` (or ``self.<metric>.labels``) in
    module ``path``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
        if node.func.attr == "labels" and name == metric:
            found.update(s for arg in node.args for s in _strings(arg))
    return found


def called(path: str, name: str, index: int) -> set[str]:
    """The strings given as argument ``index`` to calls of ``name(...)`` in ``path``."""
    return {
        s
        for node in ast.walk(ast.parse((ROOT / path).read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
        and len(node.args) > index
        for s in _strings(node.args[index])
    }  # fmt: skip


def keyword_of(event: str, keyword: str) -> set[str]:
    """The strings every ``emit(<event>, <keyword>="...")`` in the packages gives."""
    found = set()
    for _, tree in sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == event
            ):
                for k in node.keywords:
                    if k.arg == keyword:
                        found.update(_strings(k.value))
    return found


def webhook_failures() -> set[str]:
    return set(typing.get_args(Failure)) | label_calls("webhooks/service.py", "FAILED")


#: (metric, label) → its values in the code. A label whose values the doc lists must be here.
VALUES: dict[tuple[str, str], Callable[[], set[str]]] = {
    ("loopmesh_loop_turns_total", "outcome"): lambda: assigned("loop_worker/turn.py", "outcome"),
    ("loopmesh_loop_turns_dead_lettered_total", "reason"): (
        lambda: label_calls("loop_worker/deadletter.py", "BURIED")
    ),
    ("loopmesh_llm_limit_unanswered_total", "outcome"): (
        lambda: label_calls("loop_worker/limiter.py", "UNANSWERED")
    ),
    ("loopmesh_tool_worker_calls_total", "status"): lambda: set(typing.get_args(ToolStatus)),
    ("loopmesh_webhook_failures_total", "failure"): webhook_failures,
    ("loopmesh_webhook_dead_letters_total", "failure"): webhook_failures,
    ("loopmesh_retries_total", "what"): lambda: keyword_of("Retry", "what"),
    ("loopmesh_errors_total", "fatal"): lambda: {"true", "false"},  # str(bool).lower()
    # the exporter: ``tokens = self.tokens.labels``, then ``tokens("chat", model, "input")``
    ("gen_ai_client_token_usage", "gen_ai_operation_name"): lambda: called(EXPORTER, "tokens", 0),
    ("gen_ai_client_token_usage", "gen_ai_token_type"): lambda: called(EXPORTER, "tokens", 2),
    ("gen_ai_client_operation_duration_seconds", "gen_ai_operation_name"): (
        lambda: label_calls(EXPORTER, "llm_duration")
    ),
    ("gen_ai_client_operation_time_to_first_chunk_seconds", "gen_ai_operation_name"): (
        lambda: label_calls(EXPORTER, "ttfc")
    ),
}


# -- the tests --------------------------------------------------------------------------------


def test_every_registered_metric_is_documented_and_every_documented_one_exists() -> None:
    code, (doc, _) = registered(), documented()
    assert len(code) > 40
    assert sorted(set(code) - set(doc)) == [], "registered but not in docs/OBSERVABILITY.md"
    assert sorted(set(doc) - set(code)) == [], "in docs/OBSERVABILITY.md but not registered"


@pytest.mark.parametrize("name", sorted(registered()))
def test_a_metric_is_documented_with_its_type_and_labels(name: str) -> None:
    doc, _ = documented()
    assert doc.get(name) == registered()[name]


def test_every_listed_label_value_is_one_the_code_gives_and_none_is_missing() -> None:
    _, listed = documented()
    unknown = sorted(set(listed) - set(VALUES))
    assert unknown == [], f"say in VALUES where the code's values of {unknown} come from"
    for key, values in VALUES.items():
        code = values()
        assert code, f"no values found in the code for {key}"
        assert listed.get(key) == code, key


def test_the_doc_says_how_many_services_up_runs() -> None:
    from loopmesh.up import UP_SERVICES

    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    text = DOC.read_text()
    assert f"`loopmesh up` runs all {words[len(UP_SERVICES)]} services" in text
