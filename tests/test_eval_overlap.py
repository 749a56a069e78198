"""scripts/eval.py warns when its windows score more tokens than the validation split holds
(the same tokens scored again), and stays quiet when they fit."""

import warnings

import pytest


def test_overlapping_windows_warn_naming_the_split():
    from scripts import eval as eval_script

    rows = [{"seq_len": 128, "tokens": 4096}, {"seq_len": 512, "tokens": 32768}]
    with pytest.warns(UserWarning, match=r"^seq_len 512: 32768 tokens scored from a "
                                         r"validation split of 4900: its windows overlap"):
        eval_script.warn_overlap(rows, 4900)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eval_script.warn_overlap(rows[:1], 4900)
