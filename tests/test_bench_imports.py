"""Every module of ``bench/`` imports, and every import statement in it (those inside
functions too, which run only when a benchmark does) names something that exists: a
broken benchmark fails the suite, not the next person who runs it.

The peers' libraries (Temporal, LangGraph, Celery...) are only in the ``bench`` extra.
Where one is missing, the module's test skips, naming it, after checking every import
of the project's own modules: a missing name in ``bench.common`` is an ``ImportError``
of the project, which is never taken for "not installed"."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

import bench

ROOT = Path(__file__).resolve().parents[1]

#: The top-level modules that only the ``bench`` extra installs, and the requirement of
#: that extra each comes from (checked against pyproject.toml below).
BENCH_ONLY = {
    "temporalio": "temporalio",
    "langgraph": "langgraph",
    "psycopg": "psycopg",
    "psycopg_pool": "psycopg",  # psycopg[pool]
    "faststream": "faststream",
    "celery": "celery",
    "redis": "celery",  # celery[redis]
    "matplotlib": "matplotlib",
}

MODULES = sorted(m.name for m in pkgutil.walk_packages(bench.__path__, "bench."))


def _bench_extra() -> dict[str, str]:
    """The ``bench`` extra's requirements by distribution name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["optional-dependencies"]["bench"]
    return {re.split(r"[\[<>=!~;\s]", r, maxsplit=1)[0].lower(): r for r in reqs}


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _bench_only(exc: ModuleNotFoundError) -> str | None:
    """The top-level module ``exc`` says is missing, when only the bench extra has it."""
    top = (exc.name or "").partition(".")[0]
    return top if top in BENCH_ONLY else None


def _imports(module: ModuleType) -> list[tuple[int, str, list[str]]]:
    """Every import statement of ``module``'s source, at any depth: (line, module
    imported, names taken from it)."""
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text(), module.__file__)
    package = module.__name__ if module.__file__.endswith("__init__.py") else module.__package__
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = "." * node.level + (node.module or "")
            absolute = importlib.util.resolve_name(name, package) if node.level else name
            found.append((node.lineno, absolute, [a.name for a in node.names]))
    return found


def _check_import(where: str, target: str, names: list[str]) -> None:
    """``import target`` / ``from target import names`` works here."""
    imported = importlib.import_module(target)
    for name in names:
        if name == "*" or hasattr(imported, name) or _installed(f"{target}.{name}"):
            continue
        raise AssertionError(f"{where}: cannot import name {name!r} from {target!r}")


def test_the_packages_a_bench_module_may_lack_are_the_bench_extras() -> None:
    extra = _bench_extra()
    assert set(BENCH_ONLY.values()) <= set(extra), set(BENCH_ONLY.values()) - set(extra)


def test_bench_modules_are_found() -> None:
    assert {"bench.common", "bench.dispatch", "bench.peers.temporal"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_a_bench_module_and_each_of_its_imports_resolve(name: str) -> None:
    extra = _bench_extra()
    missing: set[str] = set()
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = _bench_only(exc)
        if top is None:
            raise  # a project module, or a dependency no extra declares
        missing.add(top)
        # not importable here: read its imports from its source, without running it
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        module = ModuleType(name)
        module.__file__ = spec.origin
        module.__package__ = spec.parent

    for line, target, names in _imports(module):
        where = f"{name}:{line}"
        top = target.partition(".")[0]
        if top in BENCH_ONLY and not _installed(top):
            missing.add(top)
            continue
        try:
            _check_import(where, target, names)
        except ModuleNotFoundError as exc:
            if _bench_only(exc) is None:
                raise AssertionError(f"{where}: {exc}") from exc
            missing.add(_bench_only(exc) or "")
        except ImportError as exc:  # a name missing from a project module, among others
            raise AssertionError(f"{where}: {exc}") from exc

    if missing:
        needs = ", ".join(
            f"{m} (the bench extra's {extra[BENCH_ONLY[m]]!r})" for m in sorted(missing)
        )
        pytest.skip(f"{name}: its imports of the project resolve; not installed: {needs}")
