"""A peer's row says "not installed" only when the peer's own package is missing."""

import pytest

from bench.common import Missing, peer_imports


def test_a_missing_peer_package_is_reported_as_not_installed() -> None:
    expected = "no_such_peer_package not installed: make bench"
    with pytest.raises(Missing, match=expected), peer_imports("no_such_peer_package"):
        import no_such_peer_package  # noqa: F401


def test_a_missing_module_that_is_not_the_peers_is_a_failure() -> None:
    with pytest.raises(ModuleNotFoundError) as caught, peer_imports("no_such_peer_package"):
        import no_such_dependency_of_it  # noqa: F401
    assert caught.value.name == "no_such_dependency_of_it"


def test_a_project_module_that_fails_to_import_is_a_failure_not_a_missing_peer() -> None:
    broken = pytest.raises(ImportError, match="cannot import name 'free_port'")
    with broken as caught, peer_imports("bench", "bench.common"):
        from bench.common import free_port  # type: ignore[attr-defined]  # noqa: F401
    assert not isinstance(caught.value, Missing)
