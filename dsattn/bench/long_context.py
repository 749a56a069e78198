"""Long-context training cost against the sequence length: the training step's temporary
memory from the compiled program's own memory analysis (shapes only, nothing allocated:
exact and repeatable, whatever the machine's load), and measured tokens/s where a step fits
this machine's time budget. Batch 1, the tiny presets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsattn import config
from dsattn.bench.measures import time_training
from dsattn.model import Transformer
from dsattn.trainstep import loss_fn, make_optimizer

GIB = 2 ** 30
PRESETS = ("mha", "mla", "dsa", "v4", "v41")
LENGTHS = (2048, 4096, 8192, 16384, 32768, 65536)


def at_length(preset, seq_len: int, *overrides: str):
    """A preset's config trained at `seq_len`, batch 1 (max_seq_len raised to it)."""
    return config.load(preset, [*overrides, f"model.max_seq_len={seq_len}",
                                f"train.seq_len={seq_len}", "train.batch_size=1"])


def train_step_memory(cfg, seq_len: int, batch: int = 1) -> dict:
    """The compiled training step's (loss, gradients, AdamW update) memory analysis."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    tx = make_optimizer(cfg)

    def step(params, opt_state, batch, i):
        def f(p):
            return loss_fn(nnx.merge(graphdef, p), batch, i)[0]

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    mem = jax.jit(step).lower(params, jax.eval_shape(tx.init, params),
                              {"inputs": tokens, "targets": tokens},
                              jax.ShapeDtypeStruct((), jnp.int32)).compile().memory_analysis()
    return {"temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes)}


def largest_batch(cfg, seq_len: int, device_bytes: int) -> dict:
    """The largest batch of `seq_len`-token rows whose training step fits `device_bytes`: the
    compiled step's arguments (weights, optimizer state, the batch) plus its temporaries, by
    memory analysis at batch 1 and 2 and extrapolated linearly (a step's temporaries grow
    by one row's activations per row)."""
    one, two = (train_step_memory(cfg, seq_len, b) for b in (1, 2))
    per_row = two["temp_bytes"] - one["temp_bytes"]
    fixed = one["argument_bytes"] + one["temp_bytes"] - per_row
    return {"seq_len": seq_len, "temp_bytes_batch1": one["temp_bytes"],
            "temp_bytes_per_row": per_row, "argument_bytes": one["argument_bytes"],
            "largest_batch": int((device_bytes - fixed) // per_row)}


def _saved_residuals(f, *args):
    """jax's list of (aval, where it comes from) that `print_saved_residuals` prints (jax
    0.10 exports only the printing one)."""
    fn = getattr(jax.ad_checkpoint, "saved_residuals", None)
    if fn is None:
        from jax._src.ad_checkpoint import saved_residuals as fn
    return fn(f, *args)


def saved_residuals(cfg, seq_len: int, batch: int = 1) -> dict:
    """What the training step's backward pass keeps from its forward: the residuals of the
    loss's gradient (`jax.ad_checkpoint.saved_residuals`, from shapes alone), in bytes by
    dtype name, the parameters and the batch (held anyway) left out. Under `model.remat` (or
    whole blocks from `model.remat_block_from` tokens on) they are what the policy saves;
    with bfloat16 compute the saved matmul outputs are bfloat16."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

    def loss(params, batch):
        return loss_fn(nnx.merge(graphdef, params), batch, jnp.int32(0))[0]

    by_dtype: dict[str, int] = {}
    for aval, source in _saved_residuals(loss, params, {"inputs": tokens, "targets": tokens}):
        if source.startswith("from the argument"):
            continue
        name = jnp.dtype(aval.dtype).name
        by_dtype[name] = by_dtype.get(name, 0) + aval.size * aval.dtype.itemsize
    return by_dtype


def precision_memory(config_path, seq_len: int, dtypes=("float32", "bfloat16"),
                     *overrides: str) -> list[dict]:
    """One row per compute dtype (parameters float32): the training step's saved residual
    bytes by dtype (`saved_residuals`) and the compiled step's temporaries
    (`train_step_memory`), at `seq_len`, batch 1."""
    rows = []
    for dtype in dtypes:
        cfg = at_length(config_path, seq_len, *overrides, f"model.dtype={dtype}")
        res = saved_residuals(cfg, seq_len)
        rows.append({"dtype": dtype, "seq_len": seq_len, "residual_bytes": sum(res.values()),
                     "residuals_by_dtype": res, **train_step_memory(cfg, seq_len)})
    return rows


def run(config_dir, presets=PRESETS, lengths=LENGTHS, *overrides: str,
        max_step_s: float = 60.0, steps: int = 2, log=print) -> list[dict]:
    """One row per (preset, length): temp bytes always; tokens/s while a preset's previous
    step took at most `max_step_s` (a longer one would not fit the budget twice over; 0:
    memory only)."""
    rows = []
    for name in presets:
        timing = max_step_s > 0
        for t in lengths:
            cfg = at_length(f"{config_dir}/{name}.yaml", t, *overrides)
            row = {"preset": name, "seq_len": t, **train_step_memory(cfg, t)}
            if timing:
                row.update(time_training(cfg, t, 1, steps))
                timing = row["step_s"] <= max_step_s
            rows.append(row)
            log(f"{name} T={t}: temp {row['temp_bytes'] / GIB:.3f} GiB"
                + (f", {row['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in row else ""))
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'preset':<7}{'T':>7}{'temp GiB':>10}{'args GiB':>10}{'step s':>9}{'tokens/s':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        timed = "tokens_per_s" in r
        lines.append(f"{r['preset']:<7}{r['seq_len']:>7}{r['temp_bytes'] / GIB:>10.3f}"
                     f"{r['argument_bytes'] / GIB:>10.3f}"
                     + (f"{r['step_s']:>9.2f}{r['tokens_per_s']:>10.0f}" if timed
                        else f"{'-':>9}{'-':>10}"))
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any("tokens_per_s" in r for r in rows)  # --max-step-s 0: memory only
    fig, axes = plt.subplots(1, 1 + timed, figsize=(5.5 * (1 + timed), 4.2), squeeze=False)
    panels = [("temp_bytes", 1 / GIB, "training step temporaries (GiB, compiled memory "
               "analysis)"), ("tokens_per_s", 1, "training tokens/s (batch 1, 2-core CPU)")]
    for ax, (key, scale, title) in zip(axes[0], panels):
        for name in dict.fromkeys(r["preset"] for r in rows):
            mine = [r for r in rows if r["preset"] == name and key in r]
            ax.plot([r["seq_len"] for r in mine], [r[key] * scale for r in mine], "o-",
                    label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
