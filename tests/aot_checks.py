"""The compile checks of tests/test_aot.py, run by the .venv-aot interpreter (jax with the CUDA
plugin, ptxas and libtpu: `make aot-venv`): one training step and one decode step of each
kernel family, compiled from this CPU for one GPU target (h100) and one TPU target (v5e), on
one chip and on the target's mesh (8 GPUs, 4 TPU chips), with their kernels. The presets are
configs/small's (the kernels' tiles follow their head dims), at short lengths to keep the
compiles cheap: a kernel's tile sizes do not depend on the sequence length.

    .venv-aot/bin/python tests/aot_checks.py [NAME[:oversized|:unsplit] ...]

Prints one JSON object: {check name: row} (dsattn.bench.aot's row: compiled or the error,
the kernels by name); the pytest side asserts on it.
"""

import dataclasses
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other compiling processes
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dsattn import targets  # noqa: E402
from dsattn.bench import aot  # noqa: E402
from dsattn.kernels import mesh as kernel_mesh  # noqa: E402

CONFIGS = os.path.join(ROOT, "configs", "small")
TRAIN = (2, 1024)  # rows x tokens
CONTEXT = 4096
# name: (target, mesh, program, preset[, (rows, context)]): every kernel family, on each kind
# of target
CHECKS = {
    # the dense / window kernel, forward and backward (MLA's expanded heads)
    "h100/train/mla": ("h100", False, "train", "mla"),
    # the selected-entries kernel with its entry mass, and the window kernel (d = 256)
    "h100/train/v4": ("h100", False, "train", "v4"),
    # the picks of a 288-wide latent with a separate value, and the dense warm-up
    "h100/train/dsa": ("h100", False, "train", "dsa"),
    # the decode kernel over a contiguous cache (MLA) and over pages with the GPU indexer
    "h100/decode/mla": ("h100", False, "decode", "mla"),
    "h100/decode/v4": ("h100", False, "decode", "v4"),
    # on 8 GPUs: FSDP training and rows split over the chips, every kernel under shard_map
    "h100-mesh/train/v4": ("h100", True, "train", "v4"),
    "h100-mesh/decode/v41": ("h100", True, "decode", "v41"),
    # the Mosaic indexer kernel inside the decode step, on one TPU chip and on four
    "v5e/decode/v4": ("v5e", False, "decode", "v4"),
    # ... and in a prefill chunk (a thousand queries a call: the kernel tiles them for VMEM)
    "v5e/prefill/dsa": ("v5e", False, "prefill", "dsa"),
    # ... and over a batch whose page tables pass SMEM (40 rows x 8,192 pages at 128K)
    "v5e/decode/v41-many-rows": ("v5e", False, "decode", "v41", (40, 131072)),
    "v5e-mesh/decode/dsa": ("v5e", True, "decode", "dsa"),
    "v5e-mesh/train/v4": ("v5e", True, "train", "v4"),
}


def check(target: targets.Target, mesh: bool, program: str, preset: str,
          shape: tuple | None = None, sized_for: targets.Target | None = None) -> dict:
    """A check's row; ``shape``: a decode step's (rows, context) (by default a row per chip at
    CONTEXT); ``sized_for``: the target whose limits the kernels' tiles follow (by default the
    one compiled for)."""
    devices = target.devices(mesh=mesh)
    cfg = aot.preset_config(CONFIGS, preset, "kernels")
    with targets.building_for(sized_for or target):
        if program == "train":  # on a mesh, a row per chip at least
            traced, facts = aot.train(cfg, devices, max(TRAIN[0], len(devices)), TRAIN[1],
                                      mesh)
        elif program == "prefill":
            traced, facts = aot.prefill(cfg, devices, len(devices), CONTEXT, mesh)
        else:
            traced, facts = aot.decode(cfg, devices, *(shape or (len(devices), CONTEXT)),
                                       mesh)
    row = aot.analyse(traced, facts, target, cfg.model.n_layers)
    row["implementations"] = aot.choices(cfg, target.platform)
    return row


def main(names):
    """Each check by name; NAME:oversized sizes the kernels' tiles for a GPU with twice the
    target's shared memory, NAME:unsplit runs every kernel call outside shard_map (the
    failures the test must see)."""
    out = {}
    for name in names or CHECKS:
        base, _, variant = name.partition(":")
        t, mesh, program, preset, *shape = CHECKS[base]
        target, sized_for = targets.load(t), None
        if variant == "oversized":
            sized_for = dataclasses.replace(target, gpu={
                **target.gpu, "shared_memory_per_block_optin": 2 * target.shared_memory})
        elif variant == "unsplit":
            kernel_mesh.by_rows = lambda f, batch, rows, whole=(): f(rows, whole)
        elif variant:
            raise ValueError(f"unknown variant {variant!r}")
        out[name] = check(target, mesh, program, preset, *shape, sized_for=sized_for)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
