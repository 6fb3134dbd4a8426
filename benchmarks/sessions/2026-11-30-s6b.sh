#!/usr/bin/env bash
# Session 6 GPU call B: FP8 with fast accumulation (NOTES item 33) checked (gpu_check, including
# quantize_rows's codes given the GPU's scales) and its errors beside the precise setting on the
# real-looking data (fp8_study --both-accumulations); FP8 teacher sub-chunks of 512 rows against the
# automatic 1024 at the seed shape, alternating twice (item 34's prediction: -0.5..-1%); the fuzz
# (fresh seed) on the code of a5db256 onwards, which had not run the fuzz.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
run() { name=$1; limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log; tail -3 $R/$name.log; }
run gpu_check 120 python3 benchmarks/gpu_check.py --json $R/gpu_check.json
grep -E "quantize_rows|fp8|FAIL" $R/gpu_check.log | head
run fp8_study 150 python3 benchmarks/fp8_study.py --tokens 4096 --both-accumulations --json $R/fp8_study.json
grep -E "full step|accumulation vs" $R/fp8_study.log
mkdir -p /tmp/t512 && cp -r src /tmp/t512/
sed -i 's/    return ChunkRows(student, min(teacher, student))/    return ChunkRows(student, min(teacher, student, 512))/' /tmp/t512/src/cosdistill/chunked.py
grep -c "min(teacher, student, 512)" /tmp/t512/src/cosdistill/chunked.py
for round in 1 2; do
  for code in t1024 t512; do
    path=src; [ $code = t512 ] && path=/tmp/t512/src
    PYTHONPATH=$path timeout 60 python3 -m cosdistill bench --device cuda --providers ours-fp8,floor --tokens 2048,4096,8192 \
        --markdown $R/ab-$code-$round.md > $R/ab-$code-$round.log 2>&1
    echo "$code round $round"; grep -E "^\| (ours-fp8|floor) " $R/ab-$code-$round.md | awk -F'|' '{print $2, $3, $5, $6}' | tr '\n' ';'; echo
  done
done
run fuzz 200 python3 benchmarks/gpu_fuzz.py --seed 6 --cases 160 --out $R/fuzz
tar czf $OUT/results.tgz -C $R . && rm -rf $R
