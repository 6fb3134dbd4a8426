#!/usr/bin/env bash
# Session 11 GPU call F: what the memory target costs at the seed shape: chunk_size = 2048 (both heads in
# 2048-row pieces, +0.26 GB of logits buffers) against the automatic 2048 / 1024 layout, two settled rounds.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
timeout 200 python3 -m cosdistill bench --device cuda --providers ours,floor --chunk-sizes auto,2048 --rounds 2 --tokens 4096,8192 --json $R/chunk2048.json --markdown $R/chunk2048.md > $R/chunk2048.log 2>&1
echo "rc=$?" >> $R/chunk2048.log
grep -E "^\| (ours|floor)|rc=" $R/chunk2048.md $R/chunk2048.log
tar czf $OUT/results.tgz -C $R . && rm -rf $R
