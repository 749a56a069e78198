"""Run with the code before runs of equal layers nested (commit 46e758a): a tiny scanned V4.1
run dir whose (full, reuse*3) group stacked each of its four layers over the copies (a
layout of its own: today the reuse run is one slot stacked over copies x run)."""
import sys, numpy as np, jax
from dsattn import config, plan
from dsattn.train import Trainer
CFG = """
name: scan_flat_runs
model: {vocab_size: 256, d_model: 16, n_layers: 12, ffn_hidden: 32, max_seq_len: 64, scan_layers: true}
attention: {layers: "(full, reuse*3)*3", ratios: "2*12", ced_split: 0, n_heads: 2, rope_dim: 4,
            q_lora_rank: 8, o_groups: 1, entry_dim: 16, o_lora_rank: 8, window: 4, top_k: 2,
            pool_blocks: 0}
indexer: {n_heads: 2, head_dim: 8, rope_dim: 4}
train: {batch_size: 2, seq_len: 16, steps: 2, eval_every: 2, eval_batches: 1, ckpt_every: 2, log_every: 1, warmup_steps: 1}
data: {max_bytes: 20000}
"""
run = sys.argv[1]
cfg = config.loads(CFG)
print("units", plan.units(cfg))
tr = Trainer(cfg, run, quiet=True)
tr.run()
from dsattn import checkpoint
model, _, step = checkpoint.load_params(run)
toks = np.random.RandomState(0).randint(0, 256, (2, 16))
np.save(f"{run}/legacy_logits.npy", np.asarray(model(toks)))
np.save(f"{run}/legacy_tokens.npy", toks)
print("step", step)
