"""scripts/length_controls.py's probe variants: the noise rows are the fact rows with every
earlier token replaced and nothing else changed; scaling top-k keeps the parameters."""

import importlib.util
from pathlib import Path

import numpy as np

from dsattn import recall
from tests.helpers import forward, preset, tiny_model

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("length_controls",
                                              ROOT / "scripts" / "length_controls.py")
length_controls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(length_controls)

SOURCE = ("data.source=recall:format=mqar,joint=1,block=64,pairs=8,keys=8,values=16,"
          "min_dist=2,max_dist=62,length=20000")


def test_noise_rows_differ_from_fact_rows_only_before_the_probe_block():
    cfg = preset("v4", SOURCE, "train.seq_len=64")
    facts, noise = length_controls.probes_at(cfg, 3, [2, 16, 62], 4, 64)
    assert facts.tokens.shape == noise.tokens.shape == (12, 192)
    np.testing.assert_array_equal(noise.tokens[:, 128:], facts.tokens[:, 128:])
    np.testing.assert_array_equal(noise.answer_pos, facts.answer_pos)
    assert np.isin(noise.tokens[:, :128], recall.NOISE_ALPHABET).all()
    assert not np.isin(facts.tokens[:, :128], recall.NOISE_ALPHABET).all()


def test_scaled_top_k_keeps_the_parameters():
    model = tiny_model("v4", "attention.top_k=4")
    toks = np.random.RandomState(0).randint(0, 256, (1, 24))
    same = length_controls.with_top_k(model, 4)
    np.testing.assert_allclose(np.asarray(forward(same, toks)), np.asarray(forward(model, toks)))
    wider = length_controls.with_top_k(model, 16)
    assert wider.cfg.attention.top_k == 16
    reference = tiny_model("v4", "attention.top_k=16")  # same seed: the same parameters
    np.testing.assert_allclose(np.asarray(forward(wider, toks)),
                               np.asarray(forward(reference, toks)), atol=1e-12)
