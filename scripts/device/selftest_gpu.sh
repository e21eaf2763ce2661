#!/usr/bin/env bash
# The GPU checks of the open issues on a lent device machine (one GPU), in one call of under 10 minutes.
#
#   here, once per checkout:  python -m scripts.device.wheels      (fills .whl/: what the image lacks)
#   then the device tool:     run  command "bash scripts/device/selftest_gpu.sh $(git rev-parse HEAD)"
#                                  carry [".whl"]  timeout_s 600
#
# There, with the image's python3 (its torch and Triton): the carried wheels go into $SITE ahead of the
# image's packages, ddtree is installed from this tree without dependencies, then `ddtree selftest gpu`
# runs twice, in two processes (a GPU fault in one cannot spoil the other), in the order of value
# (tools/selftest/parts.py), so that the issues' measurements come first and a slow part cannot starve them:
#   1. issues.json: part (c), the Kimi K2.6 TP-8 rank step at 8k context first (eager vs graphs), then
#      part (e), the drafter's transport and device tree;
#   2. rest.json: the lossless part (greedy DDTree against AR in bf16, 16 prompts x 256 tokens in flight, row
#      invariance on and off; no verifier started past LOSSLESS_S), part (a) the kernels against their
#      references, row invariance (when installed), (d) deployment, and last (b) serving end to end,
#      bounded by SERVING_S, in the time left.
# Everything, the log included, is written to $OUT (the device tool returns it; runs/device here), each
# JSON saved atomically after every row of every part, and no part starts a new shape, context or stack
# past its deadline, so a run stopped at its time limit still returns every row it finished.
# Exit status: 3 when the environment cannot be set up, else that of the second run (0 = every check held).
set -uo pipefail

commit=${1:?"usage: selftest_gpu.sh COMMIT (the commit of this tree: the JSON records it)"}
out=${OUT:-runs/device}
site=${SITE:-/tmp/ddtree-site}
total_s=${TOTAL_S:-560}     # this script's whole budget, the device tool's timeout_s less the file transfer
issues_s=${ISSUES_S:-300}   # at most this for the first run
serving_s=${SERVING_S:-150} # at most this for part (b): its 6.5 GB checkpoint and stacks up to 32k
lossless_s=${LOSSLESS_S:-100} # the lossless part starts no verifier past this (two verifiers, on then off)
start=$SECONDS
mkdir -p "$out"
exec > >(tee "$out/selftest_gpu.log") 2>&1

echo "== device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "cannot install the carried wheels"; exit 3; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# Editable: the package's files stay this tree's (what the JSON's commit names).
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . \
  || { echo "cannot install ddtree from this tree"; exit 3; }
python3 - <<'EOF' || exit 3
import sys, torch, triton, grpc, google.protobuf
import ddtree.cli  # every runtime import of the services, or the ImportError that says what is missing
print(f"== python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}, cuda {torch.cuda.is_available()}")
EOF

echo "== 1. the issues' measurements: parts (c) and (e)"
timeout "$issues_s" python3 -m ddtree.cli selftest gpu --commit "$commit" --out "$out/issues.json" \
  --skip-kernels --skip-serving --skip-deploy --skip-invariance --skip-lossless --deadline-s $((issues_s - 60)) \
  --step-deadline-s $((issues_s - 120))
echo "== 1. exit $?, $((SECONDS - start)) s so far"

left=$((total_s - (SECONDS - start)))
if ((left < 150)); then
  echo "== 2. skipped: $left s left"
  exit 1
fi
echo "== 2. the rest: lossless, parts (a), invariance, (d), (b), in $left s"
timeout "$left" python3 -m ddtree.cli selftest gpu --commit "$commit" --out "$out/rest.json" \
  --skip-step --skip-drafter --deadline-s $((left - 90)) --serving-budget-s "$serving_s" \
  --lossless-budget-s "$lossless_s"
status=$?
echo "== 2. exit $status, $((SECONDS - start)) s in all"
exit $status
