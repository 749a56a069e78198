#!/bin/bash
# usage: sweep.sh NAME "overrides..." [extra args]; runs one at a time
name=$1; shift
ov=$1; shift
PYTHONPATH=/work/mqar timeout 560 taskset -c 1 /work/main/.venv/bin/python scripts/recall_curve.py configs/tiny/mha.yaml model.remat=none train.ckpt_every=100000 train.eval_every=100000 $ov --out /tmp/mq/$name.json "$@" > /tmp/mq/$name.log 2>&1
