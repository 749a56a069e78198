#!/bin/bash
# usage: v4run.sh NAME STEPS extra-overrides...   (V4 recipe; distances fixed)
name=$1; steps=$2; shift 2
export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
SRC='data.source=recall:format=mqar,joint=1,block=64,pairs=8,keys=8,values=16,min_dist=2,max_dist=62,length=1000000'
cd /work/mqar && PYTHONPATH=/work/mqar timeout 560 taskset -c 1 /work/main/.venv/bin/python scripts/recall_curve.py configs/tiny/v4.yaml model.remat=none train.ckpt_every=100000 train.eval_every=100000 "$SRC" model.n_layers=2 model.d_model=64 model.ffn_hidden=256 model.tie_embeddings=false attention.n_heads=1 attention.entry_dim=64 attention.o_groups=1 train.seq_len=64 train.batch_size=32 train.lr=3e-3 train.weight_decay=0 train.min_lr_ratio=1.0 train.b2=0.98 train.steps=$steps "$@" --every ${EVERY:-100} ${EXTRA} --distances ${DISTS:-2,4,8,16,24,32,48,62} --out /tmp/mq/$name.json > /tmp/mq/$name.log 2>&1
