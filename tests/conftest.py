"""Environment for the whole suite, set before jax is imported: float64 is enabled so
decode-vs-forward comparisons are tight and near-ties cannot flip a top-k; presets that need
float32 say so. Shared helpers live in tests/helpers.py."""

import os

# The tests check numbers, not speed: LLVM at -O0 compiles XLA:CPU programs ~30% faster,
# and compiling is most of this suite's time. (Scripts the tests start inherit it.)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1 "
                                   "--xla_backend_optimization_level=0")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
