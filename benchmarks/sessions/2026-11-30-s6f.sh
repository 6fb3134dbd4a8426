#!/usr/bin/env bash
# Session 6 GPU call F: s6e's settled bench still read ours' T = 1024 round 1 at 4.06 ms against 4.56
# in round 2 (the floor 4.09 / 4.06). Is a 0.5 s settle too short for the power limiter's window,
# or does something slow ours' later calls? Each provider alone (4 rounds), then both with a 3 s
# settle; SM clock and power logged every 20 ms.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 20 > $R/smi.csv 2>&1 &
SMI=$!
B="python3 -m cosdistill bench --device cuda --tokens 1024,2048 --rounds 4"
for run in ours-alone floor-alone both-settle3; do
  case $run in
    ours-alone) args="--providers ours";;
    floor-alone) args="--providers floor";;
    both-settle3) args="--providers ours,floor --settle-s 3";;
  esac
  date +%H:%M:%S.%N > $R/$run.start
  timeout 120 $B $args --json $R/$run.json > $R/$run.log 2>&1
  date +%H:%M:%S.%N > $R/$run.stop
  echo "$run"; python3 -c "
import json
for r in json.load(open('$R/$run.json'))['rows']:
    print(' ', r['provider'], r['T'], ' '.join(f'{x:.2f}' for x in r['round_ms']))"
done
kill $SMI
tar czf $OUT/results.tgz -C $R . && rm -rf $R
