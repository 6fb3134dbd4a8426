#!/usr/bin/env bash
# Session 11 GPU call C: NOTES item 54, the streamed one-read row step (persistent programs, prefetched slices, the
# wait in PTX). Each config in its own process under a timeout: a wait that hangs loses one line, not the call.
# Ran on commit 0f10d3b: the stream kernel was removed from the study after this run (NOTES item 54).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
study() { rows=$1; vocab=$2; shift 2; for config in "$@"; do
  timeout 45 python3 benchmarks/one_read_row_step_study.py --rows $rows --vocab $vocab --configs $config 2>&1 | grep -v "^library" | tail -3 | tee -a $R/stream_$vocab.log
  echo "rc=$? $config" >> $R/stream_$vocab.log; done; }
timeout 60 python3 benchmarks/one_read_row_step_study.py --rows 2048 --configs slices:4096:4:halves 2>&1 | tail -3 | tee $R/reference.log
study 2048 128256 stream:2048:8:4:2:nowait stream:2048:8:4:2 stream:2048:8:4:2:halves stream:1024:4:4:4:nowait stream:1024:4:4:4 \
  stream:2048:8:6:2 stream:1024:4:6:4 stream:4096:8:4:1 stream:2048:4:4:4
study 1024 262144 stream:2048:8:4:2 stream:1024:4:4:4 stream:2048:8:4:2:nowait
tar czf $OUT/results.tgz -C $R . && rm -rf $R
