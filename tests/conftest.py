"""Shared fixtures. float64 is enabled for the whole suite so decode-vs-forward comparisons
are tight and near-ties cannot flip a top-k; presets that need float32 say so."""

import os
from functools import lru_cache

# The tests check numbers, not speed: LLVM at -O0 compiles XLA:CPU programs ~30% faster,
# and compiling is most of this suite's time. (Scripts the tests start inherit it.)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1 "
                                   "--xla_backend_optimization_level=0")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from flax import nnx  # noqa: E402

from dsattn import config  # noqa: E402
from dsattn.model import Transformer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def preset(name: str, *overrides: str):
    return config.load(os.path.join(ROOT, "configs", "tiny", f"{name}.yaml"), list(overrides))


@lru_cache(maxsize=None)
def tiny_model(name: str, *overrides: str, seed: int = 0):
    """A float64 model of a tiny preset (cached: building one costs seconds on CPU)."""
    cfg = preset(name, "model.dtype=float64", *overrides)
    return Transformer(cfg, rngs=nnx.Rngs(seed))


_forward_jit = jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state)(tokens),
                       static_argnums=0)


def forward(model, tokens):
    """The teacher-forced forward, jitted (eager dispatch is ~6x slower for these models)."""
    import jax.numpy as jnp

    graphdef, state = nnx.split(model)
    return _forward_jit(graphdef, state, jnp.asarray(tokens))
