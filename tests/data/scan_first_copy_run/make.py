"""Run with the code before fixed scan carries (commit 49035c5): a tiny scanned V4.1 run dir
whose groups that write the context ran their first copy unrolled (a layout of its own)."""
import sys, numpy as np, jax
from dsattn import config, plan
from dsattn.train import Trainer
CFG = """
name: scan_first_copy
model: {vocab_size: 256, d_model: 16, n_layers: 13, ffn_hidden: 32, max_seq_len: 64, scan_layers: true}
attention: {layers: "(full, reuse)*3, full, (reindex, reuse)*3", ratios: "2*6, 1*7",
            ced_split: 6, n_heads: 2, rope_dim: 4, q_lora_rank: 8, o_groups: 1, entry_dim: 16,
            o_lora_rank: 8, window: 4, top_k: 2, pool_blocks: 1, pool_block_size: 2}
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
