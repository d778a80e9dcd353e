"""min_tokens in the Batch (``batch._hold_back``): the stop ids cannot be sampled,
unless nothing else could be (a grammar that allows only them wins)."""

from __future__ import annotations

import numpy as np

from triollm.batch import _hold_back


def test_the_stop_ids_are_masked_out_of_the_row() -> None:
    row = np.array([0.5, 3.0, 1.0, 2.0], dtype=np.float32)
    _hold_back(row, np.array([1, 3, 99]))  # 99: past this row (a wider tokenizer)
    assert row.tolist() == [0.5, -np.inf, 1.0, -np.inf]
    assert int(np.argmax(row)) == 2


def test_a_row_where_only_stop_ids_remain_is_left_as_it_was() -> None:
    row = np.array([-np.inf, 3.0, -np.inf], dtype=np.float32)  # a grammar: only id 1
    _hold_back(row, np.array([1]))
    assert row.tolist() == [-np.inf, 3.0, -np.inf]
