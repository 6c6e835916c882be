#!/bin/bash
# Submit the remaining stages of a megatron-cascade plan as a chain of Slurm jobs.
#
#   slurm/submit_cascade.sh CONFIG [key=value ...]
#
# Asks `$MEGATRON_CASCADE_CMD stages CONFIG [key=value ...]` for the plan (one
# "<stage>\t<complete|partial|pending>" line per stage, in cascade order), skips complete
# stages and submits every other stage as its own job running slurm/stage.sbatch:
#   --job-name=<stage>  --dependency=afterok:<previous job>  --kill-on-invalid-dep=yes
# so stage N+1 starts only after stage N completed, and a failed stage cancels all later ones.
# Partial stages resume from their last checkpoint.
#
# Output (stdout): one "<stage> <jobid>" line per submitted stage, then one summary line.
# Notes and skipped stages go to stderr.
#
# Environment (all optional; also exported to the jobs, see slurm/stage.sbatch):
#   MEGATRON_CASCADE_CMD  trainer command, word-split              (default: megatron-cascade)
#   VENV                  virtualenv to activate (here and in every task)
#   SBATCH_EXTRA_ARGS     extra sbatch options, word-split, e.g. "--nodes=4 --time=08:00:00
#                         --account=myacct --partition=batch"; they override the #SBATCH defaults
#   LOG_DIR               where the per-stage logs <stage>_<jobid>.log go (default: logs/slurm)
#   STAGE_SCRIPT          job script (default: stage.sbatch next to this script)
#   DRY_RUN=1             print the sbatch commands instead of submitting
set -euo pipefail

log() { printf 'submit_cascade: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
fi
CONFIG=$1
shift
OVERRIDES=("$@")

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STAGE_SCRIPT=${STAGE_SCRIPT:-$SCRIPT_DIR/stage.sbatch}
[[ -f $STAGE_SCRIPT ]] || die "job script not found: $STAGE_SCRIPT"
LOG_DIR=${LOG_DIR:-logs/slurm}
read -r -a CMD <<< "${MEGATRON_CASCADE_CMD:-megatron-cascade}"
[[ ${#CMD[@]} -gt 0 ]] || die "MEGATRON_CASCADE_CMD is empty"
EXTRA=()
if [[ -n ${SBATCH_EXTRA_ARGS:-} ]]; then
    read -r -a EXTRA <<< "$SBATCH_EXTRA_ARGS"
fi

if [[ -n ${VENV:-} ]]; then
    # shellcheck disable=SC1091  # the user's virtualenv
    source "$VENV/bin/activate"
fi

# ---- the plan ------------------------------------------------------------------------
if ! PLAN=$("${CMD[@]}" stages "$CONFIG" "${OVERRIDES[@]}"); then
    die "'${CMD[*]} stages $CONFIG ${OVERRIDES[*]}' failed; nothing submitted"
fi
STAGES=()
STATUSES=()
while IFS=$'\t' read -r name status rest; do
    [[ -z $name ]] && continue
    [[ -z ${rest:-} ]] || die "bad plan line (expected '<stage>\\t<status>'): $name $status $rest"
    case $status in
        complete | partial | pending) ;;
        *) die "bad status '$status' for stage '$name' (expected complete|partial|pending)" ;;
    esac
    STAGES+=("$name")
    STATUSES+=("$status")
done <<< "$PLAN"
[[ ${#STAGES[@]} -gt 0 ]] || die "the plan of $CONFIG has no stages"

# ---- submit ------------------------------------------------------------------------------
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
SUBMITTED=()
cancel_submitted() {
    if [[ ${#SUBMITTED[@]} -gt 0 && -z ${DRY_RUN:-} ]]; then
        log "cancelling the jobs already submitted: ${SUBMITTED[*]}"
        scancel "${SUBMITTED[@]}" || true
    fi
}
PREV=""
for i in "${!STAGES[@]}"; do
    stage=${STAGES[$i]}
    status=${STATUSES[$i]}
    if [[ $status == complete ]]; then
        log "stage $stage: complete, skipped"
        continue
    fi
    [[ $status == partial ]] && log "stage $stage: partial, will resume from its last checkpoint"
    args=(--parsable --job-name="$stage" --output="$LOG_DIR/%x_%j.log" --kill-on-invalid-dep=yes)
    if [[ -n $PREV ]]; then
        args+=(--dependency="afterok:$PREV")
    fi
    args+=("${EXTRA[@]}" "$STAGE_SCRIPT" "$CONFIG" "$stage" "${OVERRIDES[@]}")
    if [[ -n ${DRY_RUN:-} ]]; then
        printf 'sbatch'
        printf ' %q' "${args[@]}"
        printf '\n'
        job="DRYRUN$i"
    else
        if ! out=$(sbatch "${args[@]}"); then
            cancel_submitted
            die "sbatch failed for stage $stage"
        fi
        job=${out%%;*}
        [[ $job =~ ^[0-9]+$ ]] || { cancel_submitted; die "unexpected sbatch output: $out"; }
    fi
    SUBMITTED+=("$job")
    echo "$stage $job"
    PREV=$job
done

if [[ ${#SUBMITTED[@]} -eq 0 ]]; then
    echo "all ${#STAGES[@]} stages complete: nothing to submit"
else
    echo "submitted ${#SUBMITTED[@]} of ${#STAGES[@]} stages; final job $PREV; logs in $LOG_DIR"
fi
