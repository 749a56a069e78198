"""bfloat16 compute against float32, as a training run sees it: each preset trained for the
same steps on the same batches under both compute dtypes (float32 weights and optimizer
state either way), its final held-out loss side by side, and what the backward pass keeps
(dsattn.bench.long_context.saved_residuals) at a longer length."""

from __future__ import annotations

import os
import tempfile

from dsattn import config
from dsattn.bench.long_context import at_length, saved_residuals
from dsattn.train import Trainer

DTYPES = ("float32", "bfloat16")


def final_validation_loss(cfg) -> float:
    """Train cfg for its train.steps in a temporary run directory; the held-out loss after."""
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir, quiet=True)
        trainer.run()
        return float(trainer.validation_loss())


def parity(config_dir, presets, steps: int, *overrides: str, residual_len: int = 8192,
           log=print) -> list[dict]:
    """One row per preset: validation loss after `steps` under each compute dtype, their
    relative difference, and the saved residual bytes at `residual_len` tokens (batch 1)."""
    rows = []
    for name in presets:
        path = os.path.join(os.fspath(config_dir), f"{name}.yaml")
        row = {"preset": name, "steps": steps}
        for dtype in DTYPES:
            cfg = config.load(path, [*overrides, f"train.steps={steps}", f"model.dtype={dtype}"])
            row[f"val_loss_{dtype}"] = final_validation_loss(cfg)
            res = saved_residuals(at_length(path, residual_len, *overrides,
                                            f"model.dtype={dtype}"), residual_len)
            row[f"residual_bytes_{dtype}"] = sum(res.values())
        row["val_loss_rel_diff"] = (row["val_loss_bfloat16"] / row["val_loss_float32"]) - 1
        row["residual_ratio"] = row["residual_bytes_bfloat16"] / row["residual_bytes_float32"]
        row["residual_len"] = residual_len
        rows.append(row)
        log(table([row]).splitlines()[-1])
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'preset':<7}{'steps':>6}{'val f32':>9}{'val bf16':>10}{'diff':>8}"
            f"{'resid f32 MiB':>15}{'bf16 MiB':>10}{'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['preset']:<7}{r['steps']:>6}{r['val_loss_float32']:>9.4f}"
                     f"{r['val_loss_bfloat16']:>10.4f}{r['val_loss_rel_diff']:>+8.2%}"
                     f"{r['residual_bytes_float32'] / 2**20:>15.1f}"
                     f"{r['residual_bytes_bfloat16'] / 2**20:>10.1f}{r['residual_ratio']:>7.3f}")
    return "\n".join(lines)
