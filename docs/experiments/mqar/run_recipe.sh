#!/bin/bash
# usage: dsrun.sh NAME overrides... -- recall_curve args
export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
name=$1; shift
cd /work/mqar && PYTHONPATH=/work/mqar timeout 560 taskset -c 1 /work/main/.venv/bin/python scripts/recall_curve.py ${CFG:-configs/tiny/mha.yaml} model.remat=none train.ckpt_every=100000 train.eval_every=100000 "$@" --out /tmp/mq/$name.json > /tmp/mq/$name.log 2>&1
