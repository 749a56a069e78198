"""Pallas kernels, each beside a pure-jnp reference (indexer_score: the paged indexer score pass)."""
