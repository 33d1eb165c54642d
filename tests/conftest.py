"""Every test starts as a fresh kernel would: no exercise remembers earlier wrong answers."""
import pytest


@pytest.fixture(autouse=True)
def fresh_hints():
    from labkit.exercises import reset_hints
    reset_hints()
    yield
