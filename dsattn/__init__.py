"""dsattn: DeepSeek's attention designs (MLA, DSA, CSA/HCA, CSA2) in JAX/Flax NNX."""

from dsattn import config  # noqa: F401

__version__ = "0.1.0"
