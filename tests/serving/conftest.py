import pytest

from serving_helpers import make_tiny_target


@pytest.fixture(scope="session")
def tiny():
    """The tiny seeded target with a character-level tokenizer (shared: it is read-only)."""
    return make_tiny_target()
