#!/usr/bin/env bash
# Session 6 GPU call D: why the same code reads 1.04x or 1.20x at T = 1024 (NOTES item 35). In s6c,
# ours' second round ran 13% slower than its first at T = 1024 and 2048 while the floor's did not.
# SM clock, power and temperature logged every 100 ms beside: ours and the floor alone (4 rounds),
# then with naive and Liger between them (4 rounds), then alone again.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > $R/smi.csv 2>&1 &
SMI=$!
B="python3 -m cosdistill bench --device cuda --tokens 1024,2048 --rounds 4"
for run in alone-1 with-others alone-2; do
  providers=ours,floor; [ $run = with-others ] && providers=ours,naive,liger,floor
  date +%H:%M:%S.%N > $R/$run.start
  timeout 150 $B --providers $providers --json $R/$run.json --markdown $R/$run.md > $R/$run.log 2>&1
  date +%H:%M:%S.%N > $R/$run.stop
  echo "$run"; python3 -c "
import json, sys
for r in json.load(open('$R/$run.json'))['rows']:
    print(' ', r['provider'], r['T'], ' '.join(f'{x:.2f}' for x in r['round_ms']))"
done
kill $SMI
tar czf $OUT/results.tgz -C $R . && rm -rf $R
