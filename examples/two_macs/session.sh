#!/usr/bin/env bash
# A two-Mac session: one Mac is the head (say a Mac Studio), the other joins (say a MacBook). Run each step on the
# Mac named, from the repository root, with the virtual environment's bin/ on PATH (raytrm, ray):
#
#   studio$  bash examples/two_macs/session.sh head                  # prints the join command and the token's scp
#   macbook$ scp studio.local:.ray/auth_token ~/.ray/auth_token && chmod 600 ~/.ray/auth_token
#   macbook$ bash examples/two_macs/session.sh join 192.168.1.10     # the head's address, as `head` printed it
#   studio$  bash examples/two_macs/session.sh tune                  # a tuning job: one profile per tier
#   studio$  bash examples/two_macs/session.sh export                # the profiles, and the table per tier
#   each$    bash examples/two_macs/session.sh train-here PROFILE    # one Mac alone, no Ray, with its tier's profile
#   studio$  bash examples/two_macs/session.sh train-both P1 P2      # both Macs train one model (Ray Train)
#   each$    bash examples/two_macs/session.sh stop
#
# RUNS (default ~/raytrm-runs) is where the head keeps the tuning run; for train-both it must be a folder every Mac
# mounts at the same path (cluster/README.md, "Shared storage"). TIER, if set, is advertised instead of the probed
# tier (the Linux rehearsal in README.md sets it). Expected output: README.md beside this script.
set -euo pipefail

RUNS=${RUNS:-$HOME/raytrm-runs}
TUNE=$RUNS/two-macs-tune
HERE=$(cd "$(dirname "$0")" && pwd)

run() {
    echo "\$ $*"
    "$@"
}

case ${1:-} in
head)
    run raytrm cluster head ${TIER:+--tier "$TIER"} ;;
join)
    run raytrm cluster join "$2" ${TIER:+--tier "$TIER"}
    run raytrm cluster status ;;
tune)
    # Submitted as a Ray job on the head: it survives this terminal, and `ray job logs` shows its trial lines.
    # Without RAY_AUTH_MODE a job submission sends no token, and the head refuses it.
    RAY_AUTH_MODE=token run ray job submit --address http://127.0.0.1:8265 --working-dir "$HERE" -- \
        raytrm tune --space space.yaml --out "$TUNE" ;;
export)
    run raytrm export "$TUNE"
    run raytrm report "$TUNE" ;;
train-here)
    # Trains with exactly the profile's settings for its horizon (--steps or --time-budget replace it).
    run raytrm train --profile "$2" --out "$RUNS/alone-$(basename "$2" .yaml)" ;;
train-both)
    # One worker per Mac, each with its own tier's profile; shares start from the profiles' measured samples/s.
    run raytrm train --address auto --profile "$2" --profile "$3" --out "$RUNS/two-macs-train" ;;
stop)
    run raytrm cluster stop ;;
*)
    sed -n '2,16p' "$0"
    exit 2 ;;
esac
