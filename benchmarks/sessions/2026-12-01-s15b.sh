#!/usr/bin/env bash
# Session 15 GPU call B: item 67's launch_configs (the first layout without a spill, most blocks then warps
# per SM) with s14j's label fix-up, against 0d578a8: which layout _launch picks at 13 vocabularies on this
# NVRTC; the study at the two picks s15a did not time; the full step call by call at V = 262144, 151936 and
# the seed; gpu_check; GPU fuzz.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -${TAIL:-3} $R/$name.log; }
mkdir -p /tmp/old && tar xf benchmarks/sessions/old_src_0d578a8.tar -C /tmp/old
TAIL=14 run picks 120 python3 -c "
import torch
from cosdistill import row_step_cuda as r
for vocab in (1000, 32000, 49152, 65536, 98304, 100352, 128256, 151936, 200064, 256000, 262144, 400000, 819200):
    kernel, layout = r._launch(vocab, torch.int64, 0)
    print(vocab, tuple(layout), 'of', [tuple(l) for l in r.launch_configs(vocab)], r.kernel_attribute(kernel, r._NUM_REGS), 'registers',
          r.max_active_clusters(kernel, layout, r._shared_bytes(vocab, *layout)), 'clusters at once')
"
TAIL=12 run study_v200064 120 python3 benchmarks/cluster_row_step_study.py --old /tmp/old/src --in-step --vocabs 200064 --launches 16:256:1 16:224:2
TAIL=10 run study_v98304 120 python3 benchmarks/cluster_row_step_study.py --old /tmp/old/src --in-step --vocabs 98304 --launches 8:256:1
grep -chE "NaN rows as spec True" $R/study_*.log; grep -hE "rel err [0-9.]+e-0[0-5]|False|rror" $R/study_*.log | head
TAIL=4 run ab_v262144 130 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 4096 --modes full --pairs 60 --vocab 262144 --hidden 2048 --json $R/ab_v262144.json
TAIL=4 run ab_v151936 130 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 4096 --modes full --pairs 40 --vocab 151936 --hidden 3584 --json $R/ab_v151936.json
TAIL=6 run ab_seed 150 python3 benchmarks/ab_study.py --old /tmp/old/src --tokens 1024 2048 --modes full --pairs 100 --json $R/ab_seed.json
run gpu_check 100 python3 benchmarks/gpu_check.py --seed-tokens 4096 --json $R/gpu_check.json
grep -E "FAIL|row step cuda" $R/gpu_check.log | head
TAIL=6 run fuzz 100 python3 benchmarks/gpu_fuzz.py --seed 18 --cases 80 --out $R/fuzz
tar czf $OUT/results.tgz -C $R . && rm -rf $R
