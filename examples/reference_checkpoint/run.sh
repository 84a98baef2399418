#!/usr/bin/env bash
# Continue training from a checkpoint saved by the TRM reference (SamsungSAILMontreal/TinyRecursiveModels, keys
# _orig_mod.model.inner.*). Without one at hand, this script first makes one: a tiny raytrm run exported in the
# reference's layout. With your own, set REF=path/to/checkpoint and CONFIG to the config of its model.
# Run from the repository root; about two minutes on a 2-core CPU. Expected output: README.md beside this script.
set -euo pipefail

OUT=${OUT:-runs/reference_checkpoint}
CONFIG=${CONFIG:-examples/reference_checkpoint/tiny.yaml}

run() {
    echo "\$ $*"
    "$@"
}

if [ -z "${REF:-}" ]; then
    REF=$OUT/reference.pt
    run raytrm train --config "$CONFIG" --out "$OUT/made" --quiet
    run raytrm export-checkpoint "$OUT/made" --out "$REF"       # the EMA weights, in the reference's keys
fi
run raytrm import-checkpoint "$REF" --out "$OUT/continued" --config "$CONFIG"
run raytrm train --out "$OUT/continued" --resume --steps 60
