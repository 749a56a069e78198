"""The longest chain of dependent kernels (dsattn.bench.kernel_chain) of hand-built programs
whose chain is known: parallel matmuls count once on the chain and each in the counts, a
jit body and a cond's longer branch are followed (its other branch not counted), a scan's
body counts once per iteration along its carry (a product of its inputs alone once),
a Pallas call counts once whatever it holds, and elementwise work counts nothing."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsattn.bench import kernel_chain

X, W = jnp.ones((2, 8)), jnp.ones((8, 8))


def _double(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], x_ref[...].T) @ x_ref[...]  # two dots inside
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=True)(x)


def program(x, w, flag):
    a = jnp.tanh(x @ w) @ w  # 2 on the chain
    side = x @ w  # beside it: not on the chain
    b = jax.jit(lambda y: y @ w)(a)  # 3, inside a jit
    c = jax.lax.cond(flag, lambda y: (y @ w) @ w, lambda y: y @ w.T, b)  # 5 by the longer branch
    d = jax.lax.scan(lambda y, _: (y @ w, None), c, None, length=4)[0]  # 9
    # a product of each iteration's input alone: once on the chain, whatever the length
    d = d + jax.lax.scan(lambda y, x: (y + x @ w, None), d, jnp.stack([x] * 5))[0]
    e = _double(d)  # 10: one Pallas call
    i = jax.lax.top_k(e, 2)[1]  # 11
    return e.at[0, i[0]].set(side[0, :2]), i  # 12: the scatter


def test_chain_of_a_known_program():
    chain = kernel_chain.of_jaxpr(jax.make_jaxpr(program)(X, W, True))
    assert chain.length == 12
    assert [op for op, _ in chain.path] == ["dot_general"] * 9 + ["pallas_call", "top_k",
                                                                   "scatter"]
    # every dot: 2 + 1 beside + 1 in the jit + 2 in the cond's larger branch + 4 + 5 in
    # the scans
    assert chain.counts == {"dot_general": 15, "pallas_call": 1, "top_k": 1, "scatter": 1}
    assert all(where.startswith("test_kernel_chain.") for _, where in chain.path)


def test_elementwise_work_is_no_kernel_on_the_chain():
    chain = kernel_chain.of_jaxpr(jax.make_jaxpr(lambda x: jnp.exp(x) * 2 + x)(X))
    assert (chain.length, chain.counts) == (0, {})


def test_an_mha_decode_step_chains_seven_kernels_a_layer():
    """Per layer: the q/k/v projections (parallel), the cache write (the read that follows
    is of the cache written in place), the scores, the mix, the output projection, the
    FFN's gate/up (parallel) and down; then the logits."""
    from dsattn.bench import lower
    from tests.helpers import preset

    for layers in (1, 3):
        chain = lower.decode_chain(preset("mha", f"model.n_layers={layers}",
                                          "model.scan_layers=false"), 1, 64)
        assert chain.length == 7 * layers + 1
        assert [op for op, _ in chain.path[:7]] == ["dot_general", "scatter"] + [
            "dot_general"] * 5
