"""Scanned layer groups (model.scan_layers, scan.units): a stack whose repeated groups run
as one scan over stacked parameters computes what the unrolled stack computes with the same
weights, and its cached prefill/decode reproduces its forward. The patterns repeat DSA
layers (paged caches stacked), V4 (csa, hca*2) groups (compressor states stacked) and V4.1
groups on both sides of a CED split, so the scans carry shared entries, selections and the
candidate pool, with runs of equal layers nested inside a group's scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import checkpoint, scan
from dsattn.bench import lower
from dsattn.model import Transformer
from tests.helpers import check_decode_matches_forward, forward, loss_and_grads, preset

PATTERNS = {
    "dsa": ("dsa",),  # 4 layers: one, then a scan over 3 (stacked paged caches)
    # a scanned group of full layers after a full layer of another ratio: the context it
    # finds holds entries of another shape than the ones it writes
    "v41_ratios": ("v41", "model.n_layers=4", "attention.ced_split=0",
                   "attention.layers=full*4", "attention.ratios=2, 1*3"),
}


# Runs of equal layers in a repeated group scan again inside each copy (scan.Unit.runs). With
# groups and runs of two copies, short stacks hold every kind of slot: a V4 compressor (csa)
# alone then a run of hca layers; a V4.1 encoder whose full layers publish from a run and
# whose reuse run borrows from it, and a decoder whose full layer (alone) builds the pool a
# run of reindex layers reads, each publishing the selection the reuse layer after it takes
# (single layers in a group as well: a csa, the decoder's full and reuse layers).
RUNS = {
    "v4": ("v4", "model.n_layers=6", "attention.layers=(csa, hca*2)*2",
           "attention.ratios=(4, 8, 8)*2"),
    "v41": ("v41", "model.n_layers=16", "attention.ced_split=8",
            "attention.layers=(full*2, reuse*2)*2, (full, reindex*2, reuse)*2",
            "attention.ratios=2*8, 1*8"),
}


def _models(name, patterns=PATTERNS):
    """(unrolled model, scanned model with the unrolled one's weights)."""
    base, *overrides = patterns[name]
    unrolled_cfg = preset(base, "model.dtype=float64", "model.scan_layers=false", *overrides)
    scanned_cfg = preset(base, "model.dtype=float64", "model.scan_layers=true", *overrides)
    assert any(u.scanned for u in scan.units(scanned_cfg))
    unrolled = Transformer(unrolled_cfg, rngs=nnx.Rngs(0))
    scanned = Transformer(scanned_cfg, rngs=nnx.Rngs(1))
    weights = checkpoint.relayout(nnx.to_pure_dict(nnx.state(unrolled)),
                                  scan.units(unrolled_cfg), scan.units(scanned_cfg))
    state = nnx.state(scanned)
    nnx.replace_by_pure_dict(state, weights)
    nnx.update(scanned, state)
    return unrolled, scanned


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_scanned_stack_equals_unrolled_and_decodes_its_forward(name):
    unrolled, scanned = _models(name)
    toks = np.random.RandomState(0).randint(0, 256, (2, 40))
    np.testing.assert_allclose(np.asarray(forward(scanned, toks)),
                               np.asarray(forward(unrolled, toks)), rtol=0, atol=1e-12)
    check_decode_matches_forward(scanned, lengths=[5, 27], n_decode=4, max_len=40)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_nested_runs_equal_unrolled_and_decode_their_forward(name, monkeypatch):
    monkeypatch.setattr(scan, "MIN_SCAN_COPIES", 2)
    unrolled, scanned = _models(name, RUNS)
    assert any(max(u.runs) > 1 for u in scanned.units if u.scanned)
    toks = np.random.RandomState(1).randint(0, 256, (2, 40))
    np.testing.assert_allclose(np.asarray(forward(scanned, toks)),
                               np.asarray(forward(unrolled, toks)), rtol=0, atol=1e-12)
    check_decode_matches_forward(scanned, lengths=[6, 29], n_decode=4, max_len=40)


def test_nested_runs_train_as_unrolled(monkeypatch):
    """The training step through a run's scan nested in a group's rematerialised scan: the
    unrolled stack's loss and, laid out per layer, its gradients (the V4 stack; V4.1's 16
    float64 layers would add 25 s for the same code path)."""
    monkeypatch.setattr(scan, "MIN_SCAN_COPIES", 2)
    unrolled, scanned = _models("v4", RUNS)
    toks = np.random.RandomState(2).randint(0, 256, (2, 25))
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    (metrics, grads), (metrics_u, grads_u) = (loss_and_grads(m, batch)
                                              for m in (scanned, unrolled))
    np.testing.assert_allclose(metrics["loss"], metrics_u["loss"], rtol=1e-12)
    grads = checkpoint.relayout(nnx.to_pure_dict(grads), scanned.units, unrolled.units)
    grads_u = nnx.to_pure_dict(grads_u)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_u), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-11)


# A scanned group of 4 copies: paged + ring + compressor state, and contiguous caches; the
# most the step's temporaries may exceed the unrolled step's, in layers' caches: V4's HCA
# layer gathers every entry it attends (~0.4 of a layer's cache here) inside the scan's body,
# where XLA does not share the buffer with the unrolled layers' gathers.
IN_PLACE = {
    "v4": (0.5, "v4", "model.n_layers=8", "attention.layers=(csa, hca)*4",
           "attention.ratios=(4, 8)*4"),
    "mla": (0.1, "mla", "model.n_layers=4"),
    "mha": (0.1, "mha", "model.n_layers=4"),
}


def _decode_temp_bytes(cfg, max_len: int) -> tuple[int, float]:
    """(the compiled decode step's temporary bytes, one layer's cache bytes)."""
    low, cache = lower.lowered(cfg, 1, max_len)
    return (low.compile().memory_analysis().temp_size_in_bytes,
            lower.cache_value_bytes(cache) / cfg.model.n_layers)


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_scanned_decode_updates_the_stacked_caches_in_place(name):
    """A scanned decode step must not copy each copy's cache out of the stacked arrays and
    back, which holds every copy's cache whatever a layer selects (4-8 layers' worth here),
    nor copy out the part a layer reads: MHA and MLA read their whole cache, which XLA:CPU
    sliced out of the stacked array every step (a whole layer's cache). The compiled step's
    temporaries exceed the unrolled step's by a fraction of one layer's cache."""
    bound, base, *overrides = IN_PLACE[name]
    scanned, unrolled = (preset(base, f"model.scan_layers={s}", "model.dtype=float32",
                                *overrides) for s in ("true", "false"))
    assert any(u.scanned for u in scan.units(scanned))
    temp, layer = _decode_temp_bytes(scanned, 65536)
    base_temp, _ = _decode_temp_bytes(unrolled, 65536)
    assert temp - base_temp < bound * layer


def _copies(make, n=3, seed=0):
    """`n` caches made by make(rng), each written differently."""
    return [make(np.random.default_rng(seed + c)) for c in range(n)]


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("traced", [False, True])
def test_a_copys_view_of_stacked_caches_is_that_copys_cache(traced):
    """What a scan body does to copy i's view of a group's stacked caches (scan.view, then
    scan.merge and, after the scan, scan.finish) is what the same calls do to copy i's own
    cache, and leaves the other copies as they were: a paged cache of two pool groups
    (append, gather, read_all, and the kernels' flat pool), a ring (write, local_keys) and a
    contiguous cache (extend: one write held for the view, and what it attends over)."""
    from dsattn.cache import contiguous, paged, ring

    B, W, E = 4, 3, 2
    fields = {"entry": paged.Field("native", 4)}

    def make_paged(rng):
        c = paged.empty(fields, B, 7, 2, jnp.float64, groups=2)
        return paged.append(c, {"entry": jnp.asarray(rng.normal(size=(B, E, 4)))},
                            jnp.asarray(rng.integers(0, E + 1, size=B)))

    def make_ring(rng):
        r = ring.empty("native", B, W, 4, 0, jnp.float64)
        return ring.write(r, jnp.asarray(rng.normal(size=(B, 2, 4))),
                          jnp.asarray([[0, 1]] * B), jnp.ones((B, 2), bool))

    def make_contiguous(rng):
        c = contiguous.empty("native", B, 6, (), 4, 0, jnp.float64)
        pos = jnp.asarray([[0, 1]] * B)
        return contiguous.extend((c,), (jnp.asarray(rng.normal(size=(B, 2, 4))),), pos,
                                 jnp.ones((B, 2), bool), lambda segs: 0, jnp.float64)[1][0]

    caches = [{"p": p, "r": r, "c": c} for p, r, c in
              zip(_copies(make_paged), _copies(make_ring, seed=10), _copies(make_contiguous, seed=20))]
    stacked = scan.join(caches)
    rng = np.random.default_rng(99)
    new = jnp.asarray(rng.normal(size=(B, E, 4)))
    n_new = jnp.asarray([2, 0, 1, 2])
    idx = jnp.asarray(rng.integers(-1, 8, size=(B, 5)), jnp.int32)
    chunk = jnp.asarray(rng.normal(size=(B, 1, 4)))
    pos, valid = jnp.full((B, 1), 2), jnp.asarray([[True], [False], [True], [True]])

    def attended(segs):  # every (value, position, visible) the contiguous layer attends over
        return [(seg.values[0] * seg.seen[..., None], jnp.where(seg.seen, seg.pos, -1))
                for seg in segs]

    def step(cache):
        p = paged.append(cache["p"], {"entry": new}, n_new)
        got = paged.gather(p, "entry", idx, jnp.float64)
        flat, table = paged.pool(p, "entry")
        (flat,) = flat.values()
        pooled = flat[jnp.maximum(table, 0)] * (table >= 0)[..., None, None]
        keys = ring.local_keys(cache["r"], jnp.float64, chunk, pos, valid, W)
        r = ring.write(cache["r"], chunk, pos, valid)
        seen, (c,) = contiguous.extend((cache["c"],), (chunk,), pos, valid, attended,
                                       jnp.float64)
        reads = (got, paged.read_all(p, "entry", jnp.float64), pooled, keys, seen)
        return reads, {"p": p, "r": r, "c": c}

    def on_view(stacked, i):
        reads, new_view = step(scan.view(stacked, i))
        return reads, scan.finish(scan.merge(stacked, new_view, i))

    run = jax.jit(on_view) if traced else on_view
    for i in range(3):
        reads, after = run(stacked, jnp.int32(i))
        want_reads, want_cache = step(caches[i])
        _same(reads, want_reads)
        for c in range(3):
            _same(scan.unstack(after, c), want_cache if c == i else caches[c])
