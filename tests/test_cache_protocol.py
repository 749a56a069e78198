"""The cache protocol (dsattn/cache/protocol.py) is all the code around caches needs: a new
container, declared here and nowhere else, goes through scanned and unrolled stacks, cached
prefill and decode, a mesh's cache layout, the benchmarks' synthetic context, the byte
count and the server (its row clearing and page accounting) without any change to the
library.

The container holds each row's newest value vector (one slot); the attention that uses it
mixes each token's value with the previous token's, so decoding must read the cache to
reproduce the forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from dsattn import generate, model as model_lib, sharding
from dsattn.bench.measures import synthetic_context
from dsattn.cache.protocol import Container, PagePool, is_container, reading
from dsattn.model import Transformer, layer_caches
from dsattn.serve import programs
from dsattn.serve.pool import PoolLayer, pool_layers, with_pool
from dsattn.serve.request import Request
from dsattn.serve.scheduler import Scheduler
from dsattn.nn.layers import dense
from dsattn.plan import Family
from dsattn.scan import units
from tests.helpers import check_decode_matches_forward, check_two_chunk_prefill, preset


@struct.dataclass
class Previous(Container):
    """Each row's newest value vector, [B, D]."""

    value: jax.Array

    storage = "value"


@struct.dataclass
class PreviousWhole(Previous):
    """The same, declared as read whole every step (`reads_whole`: read through
    protocol.reading)."""

    reads_whole = True


@struct.dataclass
class PreviousPooled(Previous):
    """The same, declaring a page pool of `n_pages` (a static field) that its rows share:
    what the server's page accounting sees and resizes (`page_pool`, `with_pages`)."""

    n_pages: int = struct.field(pytree_node=False, default=12)

    def page_pool(self):
        return PagePool(4, self.n_pages)

    def with_pages(self, n: int):
        return self.replace(n_pages=n)


class PreviousToken(nnx.Module):
    """out_t = wo((v_t + v_{t-1}) / 2), v_{-1} = 0: a two-token window of equal weights."""

    container = Previous

    def __init__(self, cfg, spec, rngs):
        d, dtype = cfg.model.d_model, jnp.dtype(cfg.model.dtype)
        self.d, self.dtype = d, dtype
        self.wv = dense(d, d, rngs, dtype, 0.5)
        self.wo = dense(d, d, rngs, dtype, 0.5)

    def _mix(self, v, prev, positions):
        return self.wo((v + jnp.where((positions > 0)[..., None], prev, 0.0)) / 2)

    def __call__(self, x, positions, step=None, ctx=None):
        v = self.wv(x)
        return self._mix(v, jnp.pad(v, ((0, 0), (1, 0), (0, 0)))[:, :-1], positions), {}, ctx

    def init_cache(self, batch: int, max_len: int):
        return {"prev": self.container(jnp.zeros((batch, self.d), self.dtype))}

    def extend(self, x, positions, valid, cache, ctx=None):
        c, v = cache["prev"], self.wv(x)
        old = reading(c.value, lambda value: value[...])
        rows, n = jnp.arange(x.shape[0]), jnp.sum(valid, -1)  # valid: a prefix of each row
        last = jnp.where((n > 0)[:, None], v[rows, jnp.maximum(n - 1, 0)], old)
        out = self._mix(v, jnp.concatenate([old[:, None], v[:, :-1]], 1), positions)
        return out, {"prev": c.replace(value=c.value.at[rows].set(last))}, ctx


class PreviousTokenWhole(PreviousToken):
    container = PreviousWhole


@pytest.fixture(params=[PreviousToken, PreviousTokenWhole], ids=["selective", "whole"])
def previous_token(monkeypatch, request):
    """Every MHA-family layer built while the test runs uses PreviousToken, its container
    read selectively or whole."""
    monkeypatch.setitem(model_lib.ATTENTION, Family.MHA, request.param)
    return request.param.container.reads_whole


def _model(scan: bool):
    cfg = preset("mha", "model.dtype=float64", "model.n_layers=4",
                 f"model.scan_layers={str(scan).lower()}")
    assert any(u.scanned for u in units(cfg)) == scan
    return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("scan", [True, False])
def test_a_new_container_decodes_its_forward(previous_token, scan):
    model = _model(scan)
    cache = check_decode_matches_forward(model, lengths=[1, 6, 3], n_decode=3, max_len=16)
    check_two_chunk_prefill(model, [2, 5], 3, max_len=16)
    generate.check_cache(cache)
    # each layer stores one D-vector per row: B x D x 8 bytes (float64)
    for layer in layer_caches(model.cfg, cache):
        (c,) = jax.tree.leaves(layer, is_leaf=is_container)
        assert c.stored_bytes() == 3 * model.cfg.model.d_model * 8


def test_a_new_container_is_laid_out_and_filled(previous_token):
    model = _model(True)
    mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.MESH_AXES)
    state = jax.eval_shape(lambda: model.init_cache(8, 16))
    specs = sharding.cache_specs(model.units, state, mesh)
    whole = previous_token  # a scanned group keeps such a container's vectors per copy
    for unit, layer in zip(model.units, specs.layers):
        lead = (None,) if unit.scanned and not whole else ()
        for spec in jax.tree.leaves(layer, is_leaf=lambda s: isinstance(s, P)):
            assert spec == P(*lead, ("data", "fsdp"))
    cache = synthetic_context(model, model.init_cache(2, 16), 5)
    np.testing.assert_array_equal(np.asarray(cache.pos), [5, 5])
    logits, _ = generate.decode_step(model, jnp.zeros((2,), jnp.int32), cache)
    assert np.isfinite(np.asarray(logits)).all()


def test_a_new_container_serves(previous_token):
    """The scheduler clears a new container's rows by its default `cleared` (a row's
    next owner starts from the blank row) and finds no page pool: three requests on two
    rows equal their solo outputs."""
    model = _model(False)
    eng = generate.Engine(model)
    assert pool_layers(eng.cfg, eng.init_cache(2, 16)) == ()
    sched = Scheduler(eng, rows=2, max_len=16, max_chunk=16)
    reqs = [Request(prompt=p, max_new_tokens=4) for p in ([1, 2, 3], [4, 5, 6, 7, 8], [9, 3])]
    ids = [sched.submit(r) for r in reqs]
    got = sched.run()
    for rid, r in zip(ids, reqs):
        want = eng.generate([list(r.prompt)], r.max_new_tokens, max_len=16,
                            on_token=lambda row, tok: None)[0]
        assert got[rid] == list(want)
    # a cleared row holds the blank's values, the others keep theirs
    state = model.init_cache(2, 16)
    state = state.replace(layers=jax.tree.map(jnp.ones_like, state.layers))
    blank = model.init_cache(1, 16)
    cleared = programs.clear_rows(model.units, state, jnp.array([True, False]), blank)
    for layer in layer_caches(eng.cfg, cleared):
        (c,) = jax.tree.leaves(layer, is_leaf=is_container)
        assert not np.asarray(c.value[0]).any() and np.asarray(c.value[1]).any()


def test_a_pooled_container_is_counted_and_sized(monkeypatch):
    """A container that declares a page pool is one of the host's pool layers, and
    with_pool resizes it through `with_pages`, with no switch on its type in serve/."""
    class Pooled(PreviousToken):
        container = PreviousPooled

    monkeypatch.setitem(model_lib.ATTENTION, Family.MHA, Pooled)
    model = _model(False)
    state = model.init_cache(2, 16)
    n = model.cfg.model.n_layers
    assert pool_layers(model.cfg, state) == tuple(PoolLayer(i, 1, 4, 12) for i in range(n))
    small = with_pool(model.cfg, state, 10)  # ceil(10 / 4) pages
    assert pool_layers(model.cfg, small) == tuple(PoolLayer(i, 1, 4, 3) for i in range(n))
    big = with_pool(model.cfg, state, 1000)  # never more than it has
    assert pool_layers(model.cfg, big) == tuple(PoolLayer(i, 1, 4, 12) for i in range(n))
