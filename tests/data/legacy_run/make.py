"""Run with the pre-plan code (commit 46aea4e): a tiny run dir of every V4 kind and DSA."""
import sys, numpy as np, jax
jax.config.update("jax_enable_x64", False)
from dsattn import config
from dsattn.train import Trainer
from dsattn.model import Transformer
CFG = """
name: legacy_layout
model: {vocab_size: 256, d_model: 16, n_layers: 8, ffn_hidden: 32, max_seq_len: 64}
attention: {layers: "dsa, swa, hca, csa, full, reuse, full, reindex", ratios: "0, 0, 4, 4, 2, 2, 1, 1",
            ced_split: 6, n_heads: 2, head_dim: 16, rope_dim: 4, q_lora_rank: 8, o_groups: 1,
            o_lora_rank: 8, window: 4, top_k: 2, pool_blocks: 1, pool_block_size: 2,
            kv_lora_rank: 8, qk_nope_dim: 4, qk_rope_dim: 4, v_head_dim: 4}
indexer: {n_heads: 2, head_dim: 8, rope_dim: 4}
train: {batch_size: 2, seq_len: 16, steps: 2, eval_every: 2, eval_batches: 1, ckpt_every: 2, log_every: 1, warmup_steps: 1}
data: {max_bytes: 20000}
"""
run = sys.argv[1]
cfg = config.loads(CFG)
tr = Trainer(cfg, run, quiet=True)
tr.run()
from dsattn import checkpoint
model, _, step = checkpoint.load_params(run)
toks = np.random.RandomState(0).randint(0, 256, (2, 16))
np.save(f"{run}/legacy_logits.npy", np.asarray(model(toks)))
np.save(f"{run}/legacy_tokens.npy", toks)
print("step", step)
