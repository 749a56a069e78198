"""Run directories: the config a run was trained with, and orbax checkpoints of its state.

A run directory holds `config.yaml` (written once), `metrics.jsonl` and `checkpoints/`.
Restoring checks the saved config first, so a checkpoint is never loaded into a model of
another shape: the error names the first differing key.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
import yaml

from dsattn import config as config_lib

# Sections that define the weights' shapes and meaning; `train`/`data` may change on resume.
MODEL_SECTIONS = ("model", "attention", "indexer", "cache")


from dsattn.errors import CheckpointMismatch  # noqa: F401  (re-exported)


def save_config(run_dir: Path, cfg) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())


def load_run_config(run_dir, overrides=()):
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no config.yaml; is this a dsattn run directory?")
    return config_lib.load(path, overrides)


def check_compatible(run_dir: Path, cfg) -> None:
    """Raise CheckpointMismatch if run_dir was trained with a different model config."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return
    saved = yaml.safe_load(path.read_text())
    now = yaml.safe_load(cfg.to_yaml())
    for sec in MODEL_SECTIONS:
        a, b = saved.get(sec, {}), now.get(sec, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                raise CheckpointMismatch(
                    f"{run_dir}: checkpoint was trained with {sec}.{key}={a.get(key)!r}, "
                    f"this config has {sec}.{key}={b.get(key)!r}; use another run directory "
                    f"or the run's own config")


def manager(run_dir: Path, keep: int) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager((Path(run_dir) / "checkpoints").absolute(), options=opts)


def save(mngr: ocp.CheckpointManager, step: int, **items) -> None:
    """Save named pytrees (e.g. params=..., opt_state=...) as one checkpoint step."""
    mngr.save(step, args=ocp.args.Composite(
        **{k: ocp.args.StandardSave(v) for k, v in items.items()}), force=True)


def restore(mngr: ocp.CheckpointManager, step: int, **like) -> dict:
    """Restore the named items, shaped like the given pytrees."""
    args = {k: ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, v))
            for k, v in like.items()}
    return mngr.restore(step, args=ocp.args.Composite(**args))


def load_params(run_dir, cfg=None, step: int | None = None):
    """A Transformer with the latest (or given) checkpoint's parameters, and its config."""
    from flax import nnx

    from dsattn.model import Transformer

    run_dir = Path(run_dir)
    cfg = cfg or load_run_config(run_dir)
    check_compatible(run_dir, cfg)
    mngr = manager(run_dir, keep=1_000_000)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to load")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, restore(mngr, step, params=params)["params"])
    return nnx.merge(graphdef, state), cfg, step
