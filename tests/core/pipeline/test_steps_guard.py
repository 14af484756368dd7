"""A retrain never crashes on what ingest stored: sequences with foreign token ids are left out."""

import logging

from dspark_core.pipeline.steps import in_vocab
from dspark_core.training.train import Example


def test_sequences_with_ids_outside_the_vocabulary_are_left_out(caplog):
    good = [Example([1, 2, 3, 4], 2), Example([0, 63, 5], 1)]
    bad = [Example([1, 64, 3], 1), Example([1, -1, 2], 1)]
    with caplog.at_level(logging.WARNING, logger="dspark.pipeline"):
        assert in_vocab(good + bad, 64) == good
    assert "left out 2 training sequence(s)" in caplog.text
    assert in_vocab(good, 64) == good
