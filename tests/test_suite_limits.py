"""The test processes themselves: a worker that compiles thousands of programs must not run
out of the kernel's memory-map regions (vm.max_map_count). XLA:CPU maps memory for every
compiled program and keeps it while jax's caches hold the program; at the limit the next
compile segfaults, which took down a full-tier worker twice. tests/conftest.py drops jax's
caches after a test once the process holds more than DSATTN_TEST_MAPS_LIMIT regions."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

PROGRAMS = '''
import jax
import jax.numpy as jnp
import pytest


def regions():
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


@pytest.mark.parametrize("i", range(120))
def test_compile(i):
    jax.jit(lambda x: x * i)(jnp.ones(i + 1)).block_until_ready()


def test_the_regions_stay_near_the_limit():
    assert regions() < 700 + 100  # the limit, plus what one test's programs map
'''


@pytest.mark.full
def test_a_long_session_keeps_its_memory_maps_under_the_limit(tmp_path):
    """120 small programs add about 360 regions to a process that starts with about 560."""
    (tmp_path / "test_programs.py").write_text(PROGRAMS)
    env = {**os.environ, "DSATTN_TEST_MAPS_LIMIT": "700"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                        "-p", "tests.conftest", str(tmp_path / "test_programs.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
