"""Chips to compile for without having one. A target is one YAML file in configs/targets/
(h100, h200, v5e, v6e), written from the vendor's published figures; a new chip is one more
file there (or any path given where a name is). jax's `topologies.get_topology_desc` turns a
target into devices that XLA compiles for from this host: its whole GPU pipeline (Triton
kernels through ptxas included) from the GPU's description, or libtpu's for a TPU by its
topology name. That needs the `aot` extra (the CUDA plugin with ptxas, libtpu) in the
environment; jax on a CPU host then compiles, it does not run (docs/aot.md).

A target also gives the kernels their limits (`shared_memory`): the Triton kernels size
their tiles to the shared memory a block may use on the GPU the program is built for
(`building_for`), else on the smallest GPU among the targets, so a program built on a GPU
host fits every GPU listed there (add your GPU's file to make them fit it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from pathlib import Path

import yaml

DIRECTORY = Path(__file__).resolve().parents[1] / "configs" / "targets"


@dataclasses.dataclass(frozen=True)
class Target:
    """One chip: its platform (jax's lowering platform, "cuda" or "tpu"), memory, bandwidth
    and peak, and for a GPU what XLA needs to describe it (``gpu``: GpuTargetConfig fields;
    libtpu knows a TPU by its topology name). ``mesh_topology``: the chips of one host, for
    the sharded programs (8 GPUs: "1x1x8"; 4 TPU chips: "v5e:2x2"); one chip is its first."""

    name: str
    platform: str
    device: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    peak_bf16_flops: float
    mesh_topology: str
    usable_fraction: float = 0.9  # of memory_bytes a program may fill
    gpu: dict | None = None

    @property
    def usable_bytes(self) -> int:
        """The memory one program may fill."""
        return int(self.usable_fraction * self.memory_bytes)

    @property
    def shared_memory(self) -> int | None:
        """Shared memory one GPU block may opt into, in bytes (None: not a GPU)."""
        return None if self.gpu is None else int(self.gpu["shared_memory_per_block_optin"])

    def gpu_target_config(self) -> str:
        """XLA's GpuTargetConfig text proto of this GPU."""
        g = dict(self.gpu)
        major, minor = g.pop("compute_capability")
        fields = "\n".join(f"  {k}: {v}" for k, v in g.items())
        return (f"gpu_device_info {{\n{fields}\n  memory_bandwidth: "
                f"{int(self.bandwidth_bytes_per_s)}\n  device_memory_size: {self.memory_bytes}\n"
                f"  threads_per_warp: 32\n  block_dim_limit_x: 2147483647\n"
                f"  block_dim_limit_y: 65535\n  block_dim_limit_z: 65535\n"
                f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
                f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 8 }}\n'
                f"runtime_version {{ major: 12 minor: 8 }}\n"
                f'device_description_str: "{self.device}"\n')

    def devices(self, mesh: bool = False) -> list:
        """jax devices of this chip, for compiling only: one, or `mesh_topology`'s (one chip
        is the first of them: libtpu describes whole hosts)."""
        from jax.experimental import topologies

        if self.platform == "tpu":
            topo = topologies.get_topology_desc(topology_name=self.mesh_topology,
                                                platform="tpu")
        else:
            topo = topologies.get_topology_desc(
                platform=self.platform, target_config=self.gpu_target_config(),
                topology=self.mesh_topology)
        return list(topo.devices) if mesh else list(topo.devices)[:1]


def names() -> tuple[str, ...]:
    """The targets in configs/targets/."""
    return tuple(sorted(p.stem for p in DIRECTORY.glob("*.yaml")))


def load(name: str) -> Target:
    """A target by name (configs/targets/<name>.yaml) or by the path of its YAML file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else DIRECTORY / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"no target {name!r}: known targets are {', '.join(names())} "
                         f"(configs/targets/), or give a YAML file's path")
    raw = yaml.safe_load(path.read_text())
    known = {f.name for f in dataclasses.fields(Target)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{path}: unknown keys {', '.join(sorted(unknown))}; a target has "
                         f"{', '.join(sorted(known))}")
    if raw.get("platform") not in ("cuda", "tpu"):
        raise ValueError(f"{path}: platform must be cuda or tpu, got {raw.get('platform')!r}")
    return Target(**{**raw, "memory_bytes": int(raw["memory_bytes"]),
                     "usable_fraction": float(raw.get("usable_fraction", 0.9)),
                     "bandwidth_bytes_per_s": float(raw["bandwidth_bytes_per_s"]),
                     "peak_bf16_flops": float(raw["peak_bf16_flops"])})


# -- the GPU a program is built for, for the kernels' tile sizes ------------------------------
_BUILDING: contextvars.ContextVar[Target | None] = contextvars.ContextVar("target", default=None)


@contextlib.contextmanager
def building_for(target: Target):
    """Within: programs are traced for `target` (the kernels size their tiles to it)."""
    token = _BUILDING.set(target)
    try:
        yield target
    finally:
        _BUILDING.reset(token)


def shared_memory() -> int:
    """Shared memory (bytes) a GPU kernel block may use in the program being traced: the
    target's it is built for, else the smallest of the GPU targets in configs/targets/ (a
    kernel that fits it fits each of them)."""
    target = _BUILDING.get()
    if target is not None and target.shared_memory is not None:
        return target.shared_memory
    return _smallest_gpu_shared_memory()


_SMALLEST: list[int] = []


def _smallest_gpu_shared_memory() -> int:
    if not _SMALLEST:
        sizes = [t.shared_memory for t in map(load, names()) if t.shared_memory is not None]
        _SMALLEST.append(min(sizes))
    return _SMALLEST[0]
