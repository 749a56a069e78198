"""A sweep's length columns (`lengths`: loss xM, xM recall>reach) measure what they say:
recall at xM runs on rows M times as long with the probe's fact in the last probe_len
tokens, past the training length; held-out loss on windows M times the row's train.seq_len;
recall>reach averages only the distances past the row's window reach. The report names the
lengths it evaluated, flags a row whose xM recall is not past its own training length, and
says in a sentence or two what its rows show (at chance beyond the reach, against the
control), counting a guess on the shared probes as chance even when every seed makes the same
one (a zero-width interval)."""

import importlib

import numpy as np
import pytest

from dsattn import ablate, recall, recall_eval
from dsattn.ablate import results
from tests.test_ablate import MQAR, TOY, V4, _write

# the module (the package's `measure` is its function)
measure_lib = importlib.import_module("dsattn.ablate.measure")


def _mqar_sweep(tmp_path, source=MQAR, **extra):
    path = _write(tmp_path, overrides=[*TOY, source], lengths=[2, 4], decode_context=0,
                  recall={"distances": [2, 8, 30, 46], "per_distance": 6}, **extra)
    return ablate.load(path, out=tmp_path / "sweep")


@pytest.mark.parametrize("source", [MQAR, MQAR.replace("format=mqar", "format=mqar,joint=1")],
                         ids=["pairs", "joint"])
def test_xm_recall_rows_are_the_1x_rows_after_earlier_tokens(tmp_path, source):
    """Multi-query recall at xM: rows of M x probe_len tokens, the query at the end, its fact
    exactly d tokens earlier inside the last probe_len tokens (positions the model never
    trained on for M >= 2), the probe's key nowhere else in the row. The last probe_len
    tokens are the 1x row itself (the same facts and distances), and a longer multiple's rows
    end with a shorter one's. (joint=1: a fact is one token for the pair.)"""
    sweep = _mqar_sweep(tmp_path, source)
    cfg = sweep.config(sweep.rows[0], 0)
    n = cfg.train.seq_len
    assert sweep.probe_len == n == 48
    spec = cfg.data.source.recall
    key0, value0 = ((recall.MQAR_JKEY0, recall.MQAR_JVALUE0) if spec.joint else
                    (recall.MQAR_KEY0, recall.MQAR_VALUE0))
    probes = {m: measure_lib.probes_for(sweep, cfg, m) for m in (1, 2, 4)}
    for m, p in probes.items():
        rows, idx = len(p.tokens), np.arange(len(p.tokens))
        assert p.tokens.shape == (rows, m * n)
        assert sorted(set(p.distance.tolist())) == sorted(sweep.distances)
        q = p.answer_pos[:, 0] - 1  # the query's key token; its value is the answer
        assert (q == m * n - 2).all()
        fact = q - p.distance
        assert (fact >= (m - 1) * n).all()  # in the probe block, after (m - 1) x n tokens
        key, value = p.tokens[idx, q] - key0, p.tokens[idx, q + 1] - value0
        assert ((0 <= key) & (key < spec.keys) & (0 <= value) & (value < spec.values)).all()
        if spec.joint:  # the fact: one token for (key, value); the key's only one
            assert (p.tokens[idx, fact] == recall.MQAR_JOINT0 + key * spec.values + value).all()
            of_key = (p.tokens - recall.MQAR_JOINT0) // spec.values == key[:, None]
            assert ((p.tokens >= recall.MQAR_JOINT0) & of_key).sum(1).tolist() == [1] * rows
            assert ((p.tokens == (key + key0)[:, None]).sum(1) == 1).all()  # the query
        else:  # the fact `key value`; the key nowhere but the fact and the query
            assert (p.tokens[idx, fact] == key + key0).all()
            assert (p.tokens[idx, fact + 1] == value + value0).all()
            assert ((p.tokens == (key + key0)[:, None]).sum(1) == 2).all()
        # the 1x rows, after earlier tokens: the same facts, distances and answers
        assert (p.tokens[:, -n:] == probes[1].tokens).all()
        assert (p.distance == probes[1].distance).all()
    assert (probes[4].tokens[:, -2 * n:] == probes[2].tokens).all()
    # earlier tokens are the validation stream's blocks (other facts and queries), not noise
    before = probes[2].tokens[:, :n]
    assert (before >= recall.MQAR_JKEY0 if spec.joint else before >= key0).sum(1).min() > 0


WINDOW = [  # two sliding windows of 8 (reach 2 x 7 = 14 tokens): a float64 toy, untrained
    "model.n_layers=2", "model.d_model=32", "model.ffn_hidden=64", "model.dtype=float64",
    "attention.layers=swa", "attention.window=8", "attention.n_heads=1",
    "attention.entry_dim=16", "attention.rope_dim=8", "attention.q_lora_rank=16",
    "attention.o_groups=1", "attention.o_lora_rank=16", "train.seq_len=48",
    "train.batch_size=2", "train.steps=4", "train.eval_every=2", "train.warmup_steps=1"]


def test_a_window_only_stack_answers_the_same_at_x2_as_at_1x(tmp_path):
    """x2 adds earlier tokens and nothing else: a stack of sliding windows whose reach (14)
    ends inside the probe block cannot see them (RoPE is relative), so at every probe it
    predicts at x2 the answer it predicts at 1x (here an untrained model: any weights)."""
    from flax import nnx

    from dsattn.model import Transformer

    path = _write(tmp_path, base=V4, overrides=[*WINDOW, MQAR], lengths=[2], decode_context=0,
                  recall={"distances": [2, 8, 30, 46], "per_distance": 6})
    sweep = ablate.load(path, out=tmp_path / "sweep")
    cfg = sweep.config(sweep.rows[0], 0)
    assert ablate.window_reach(cfg) == 14
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    answers = {}
    for m in (1, 2):
        p = measure_lib.probes_for(sweep, cfg, m)
        pred = recall_eval.model_predictions(model, p.tokens)
        answers[m] = np.take_along_axis(pred, p.answer_pos, 1)
    assert (answers[2] == answers[1]).all()
    assert len(np.unique(answers[1])) > 1  # not one constant answer


class _Trainer:
    """What `measure` reads of a trained run, without training one."""

    def __init__(self, cfg, run_dir):
        self.cfg, self.run_dir, self.step = cfg, run_dir, cfg.train.steps
        self.params = {"w": np.zeros(3)}

    def model(self):
        return "model"


def test_measure_evaluates_each_length_on_its_own_rows(tmp_path, monkeypatch):
    """`measure` scores each multiple on that multiple's probes (rows M x 48 tokens) and its
    held-out loss on windows of M x train.seq_len, and records both lengths with the result;
    each length's numbers land under its own key (none reused from another)."""
    sweep = _mqar_sweep(tmp_path)
    row, cfg = sweep.rows[0], sweep.config(sweep.rows[0], 0)
    probes = {m: measure_lib.probes_for(sweep, cfg, m) for m in (1, *sweep.lengths)}
    scored, losses = [], []

    def accuracy(model, p):
        scored.append(p.tokens.shape[1])
        return {int(d): p.tokens.shape[1] / 1000 for d in np.unique(p.distance)}

    def held_out(model, cfg, seq_len):
        losses.append(seq_len)
        return seq_len / 100

    monkeypatch.setattr(recall_eval, "accuracy", accuracy)
    monkeypatch.setattr(measure_lib, "_held_out_loss", held_out)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    r = measure_lib.measure(sweep, row, ablate.Trained(_Trainer(cfg, run_dir), 1.0), probes)
    assert scored == [48, 96, 192] and losses == [96, 192]
    assert set(r["recall"].values()) == {0.048}
    for m in (2, 4):
        b = r["beyond"][str(m)]
        assert b["recall_seq_len"] == b["loss_seq_len"] == 48 * m
        assert b["same_probes_as_1x"] is True
        assert set(b["recall"].values()) == {48 * m / 1000} and b["val_loss"] == 48 * m / 100
    assert (r["train_seq_len"], r["probe_len"], r["per_distance"]) == (48, 48, 6)


def _result(row, seed, recall_1x, recall_2x, *, reach=14, loss=1.0, control=False,
            train_seq_len=64, per_distance=64, loss_seq_len=None):
    """A finished run's result as a sweep saves it: recall by distance (2 and 8 within a
    reach of 14; 16, 32, 62 beyond it), at 1x and at 2x (128-token rows)."""
    def by_d(within, beyond):
        return {"2": within, "8": within, "16": beyond, "32": beyond, "62": beyond}

    return {"row": row, "seed": seed, "val_loss": loss, "params": 1000, "reach": reach,
            "recall_chance": 0.0625, "loss_unit": "nats per answer token", "control": control,
            "train_tokens_per_s": 100.0, "decode_ms": None, "train_seq_len": train_seq_len,
            "probe_len": 64, "per_distance": per_distance,
            "recall": by_d(0.9, recall_1x),
            "beyond": {"2": {"val_loss": loss + 0.1, "recall": by_d(0.8, recall_2x),
                             "recall_seq_len": 128, "same_probes_as_1x": True,
                             "loss_seq_len": loss_seq_len or 2 * train_seq_len}}}


def test_xm_recall_beyond_reach_averages_only_the_distances_past_the_reach():
    r = _result("a", 0, 0.3, 0.1)
    r["beyond"]["2"]["recall"].update({"16": 0.2, "32": 0.4, "62": 0.6})
    row = results.flat(r)
    assert row["recall_x2_beyond"] == pytest.approx(0.4)  # 16, 32, 62: past 14
    assert row["recall_x2_within"] == pytest.approx(0.8)  # 2, 8
    assert row["recall_beyond"] == pytest.approx(0.3)


def test_report_names_the_lengths_and_flags_a_row_not_past_its_training_length():
    """The notes say what x2 evaluated (recall rows of 128 tokens: the 1x rows after 64
    earlier tokens; loss windows of 2 x each row's train.seq_len), and a
    row trained on 128-token rows is flagged: its x2 recall is not past its training length."""
    rs = [_result("short", s, 0.3, 0.2) for s in range(3)]
    rs += [_result("long", s, 0.3, 0.3, train_seq_len=128) for s in range(3)]
    text = results.table(rs)
    lines = [x for x in text.splitlines() if x.startswith("x2:")]
    assert lines, text
    assert "recall on 128-token rows" in lines[0]
    assert "the 1x probe rows after 64 earlier tokens (the same facts and distances)" in lines[0]
    assert "loss x2: held-out loss over windows of 2 x each row's train.seq_len" in lines[0]
    (flag,) = [x for x in text.splitlines() if x.startswith("long:")]
    assert "x2 recall rows (128 tokens) are not past its training length (128)" in flag
    assert not [x for x in text.splitlines() if x.startswith("short:")]
    # results measured when each length drew its own probes (their lengths filled in by
    # ablate.complete) are not said to be the 1x rows
    for r in rs:
        del r["beyond"]["2"]["same_probes_as_1x"]
    (line,) = [x for x in results.table(rs).splitlines() if x.startswith("x2:")]
    assert "the 1x probe rows" not in line and "each length its own draw" in line


def test_report_says_in_sentences_what_its_rows_show():
    """Under the table: which rows are at chance beyond their reach at each length (the
    window control, and a row whose three seeds all guess alike on the shared probes: a
    zero-width interval at 0.078, inside a guesser's range), which are above it, which score
    at x2 what they score at 1x, and each row against the control on recall beyond the
    pair's shorter reach."""
    rs = [_result("window", s, v, w, control=True)
          for s, (v, w) in enumerate([(0.06, 0.07), (0.05, 0.06), (0.07, 0.05)])]
    rs += [_result("csa", s, v, 0.078, loss=0.8)
           for s, v in enumerate([0.50, 0.55, 0.45])]  # x2: every seed the same guess
    rs += [_result("hca", s, v, v, loss=0.9) for s, v in enumerate([0.08, 0.05, 0.06])]
    text = results.table(rs)
    lines = text.splitlines()
    table_end = lines.index("")
    said = lines[table_end + 1:table_end + 4]
    assert said[0].startswith("Beyond each row's reach: at chance (0.0625")
    assert "at chance (0.0625; a guesser's 95% range over 192 probes " in said[0]
    assert "): window, hca; above chance: csa." in said[0]
    # hca's x2 values are its 1x values, seed by seed: said, so the equality is not a puzzle
    assert said[1] == ("At x2, beyond the reach: at chance: every row; the same as at 1x on "
                       "every seed: hca.")
    assert said[2] == ("Against the control window, recall beyond the pair's shorter reach "
                       "(Welch's 95% interval over seeds): within the seed spread: hca; "
                       "above it: csa.")
    # the zero-width interval the sentence reads as chance
    s = results.row_summaries(rs)["csa"]["recall_x2_beyond"]
    assert s["lo"] == s["hi"] == pytest.approx(0.078) and s["lo"] > 0.0625


def test_without_a_control_the_rows_are_read_against_the_lowest_loss():
    rs = [_result("a", s, 0.5, 0.5, loss=1.0 + s / 100) for s in range(3)]
    rs += [_result("b", s, 0.5, 0.5, loss=1.5 + s / 100) for s in range(3)]
    rs += [_result("c", s, 0.5, 0.5, loss=1.0 + s / 50) for s in range(3)]
    text = results.table(rs)
    assert ("Loss against the lowest mean loss (a; Welch's 95% interval over seeds): within "
            "the seed spread: c; above it: b.") in text.splitlines()
    assert "Beyond each row's reach: at chance" not in text
    assert any(x.startswith("Beyond each row's reach: above chance") for x in text.splitlines())


def test_one_seed_rows_and_results_without_chance_are_read_as_far_as_they_go():
    """One seed: no interval, the guesser's range alone decides; results saved before the
    chance level and probe count were recorded: no chance sentence, the table still prints."""
    rs = [_result("a", 0, 0.06, 0.5), _result("b", 0, 0.6, 0.06)]
    text = results.table(rs)
    assert "Beyond each row's reach: at chance (0.0625" in text
    assert "): a; above chance: b." in text and "At x2, beyond the reach: at chance: b; " \
        "above chance: a." in text
    for r in rs:
        for k in ("recall_chance", "per_distance", "train_seq_len", "probe_len"):
            del r[k]
        for b in r["beyond"].values():
            del b["recall_seq_len"], b["loss_seq_len"]
    text = results.table(rs)
    assert "at chance" not in text and "x2:" not in text and text.startswith("row")


def test_complete_fills_the_lengths_of_results_saved_before_they_were_recorded(tmp_path):
    sweep = _mqar_sweep(tmp_path)
    r = {"row": "mha", "seed": 0, "recall": {"2": 1.0},
         "beyond": {"2": {"val_loss": 1.0, "recall": {"2": 1.0}}}}
    (done,) = ablate.complete(sweep, [r])
    assert done["beyond"]["2"]["recall_seq_len"] == done["beyond"]["2"]["loss_seq_len"] == 96
    assert (done["train_seq_len"], done["probe_len"], done["per_distance"]) == (48, 48, 6)
    assert "recall_seq_len" not in r["beyond"]["2"]  # the saved result is left as it was
    assert "same_probes_as_1x" not in done["beyond"]["2"]  # not known of an older result

