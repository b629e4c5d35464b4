#!/usr/bin/env bash
# Run a margrpo_jax job on a (multi-host) Cloud TPU VM slice, from your workstation.
#
#   create: create the TPU VM slice (reused if it exists; optionally Spot and/or a queued resource)
#   setup:  copy this working tree to every worker, install requirements + jax[tpu] in ~/margrpo_jax/.venv
#   run:    start the same `python -m margrpo_jax.main ... --config.parallel.distributed=True` on all
#           workers at once (nohup, each worker logs to ~/margrpo_jax/logs/run.log)
#   logs:   copy every worker's log to runs/tpu/<name>/worker-<i>.log here and print their tails
#   stop:   SIGTERM on all workers: the job finishes its step, saves a checkpoint and exits (as on a Spot
#           preemption notice); `run` with the same arguments resumes it
#   fetch:  copy a local (non-gs://) workdir back from worker 0
#   delete: delete the slice (and its queued resource);  all: create + setup + run
#
# Every gcloud command is printed before it runs; DRY_RUN=1 prints them without running anything.
# Run `launch/tpu_pod.sh -h` for the options.
set -euo pipefail

cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
Usage: launch/tpu_pod.sh [options] COMMAND [--config.KEY=VALUE ...] [-- EXTRA_ARGS ...]

Commands:
  create   create the TPU VM slice if it does not exist (reuse it if it does)
  setup    copy the code to all workers and install requirements + jax[tpu] there
  run      start the job on all workers at once (with --config.parallel.distributed=True)
  logs     collect every worker's log into runs/tpu/NAME/ and print the tails (-f: follow one worker)
  stop     stop the job on all workers (it saves a checkpoint first; `run` again resumes it)
  fetch    copy a local workdir back from worker 0 into runs/tpu/NAME/workdir (not needed for gs://)
  delete   delete the slice (and its queued resource, if any)
  all      create + setup + run

Options (each also settable through the environment variable in brackets):
  -n, --name NAME            TPU name [TPU_NAME] (required)
  -z, --zone ZONE            zone, e.g. us-central2-b [ZONE] (required)
  -p, --project PROJECT      GCP project [PROJECT] (default: gcloud's configured project)
  -t, --accelerator-type T   e.g. v4-32, v5litepod-16, v5p-64, v6e-16 [ACCELERATOR_TYPE] (required by create)
  -r, --runtime-version V    TPU software version [RUNTIME_VERSION] (default by family: v2/v3/v4
                             tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5,
                             v6e v2-alpha-tpuv6e)
  -c, --config CFG           config [CONFIG] (default configs/shapes_rl.py:margrpo)
  -w, --workdir DIR          workdir [WORKDIR] (default runs/NAME, relative to the code dir on each worker);
                             on multi-host slices give gs://BUCKET/PATH or a directory every host
                             shares (an NFS / Filestore mount): checkpoints are written collectively
      --spot                 create a Spot slice [SPOT=1]
      --queued               create through a queued resource (waits until it is ACTIVE) [QUEUED=1];
                             its id is NAME-qr unless QR_ID is set
      --remote-dir DIR       code dir on the workers, relative to $HOME [REMOTE_DIR] (default margrpo_jax)
  -f, --follow               logs: follow worker LOG_WORKER (default 0) instead of collecting all
  -h, --help                 this message

Arguments starting with --config. (and everything after --) are passed to margrpo_jax.main unchanged.
Other environment: DRY_RUN=1 (print, do not run), JAX_VERSION (default: the jax pin in requirements.txt),
REMOTE_PYTHON (python >= 3.11 on the workers; default: the newest found, else python3.11 from apt),
SSH_FLAGS (extra flags for gcloud ssh/scp, e.g. "--internal-ip" or "--tunnel-through-iap"),
LOG_LINES (lines per worker printed by logs, default 40), NUM_WORKERS (worker count for logs when
DRY_RUN=1).

Examples:
  launch/tpu_pod.sh -n my-v4 -z us-central2-b -t v4-32 -w gs://my-bucket/margrpo/v4 all --config.num_iters=200
  launch/tpu_pod.sh -n my-v6e -z us-east5-b -t v6e-16 --spot --queued -w /mnt/shared/margrpo/v6e \
      all --config.parallel.mesh.data=-1 --config.parallel.mesh.fsdp=4
  launch/tpu_pod.sh -n my-v4 -z us-central2-b logs -f
  DRY_RUN=1 launch/tpu_pod.sh -n my-v4 -z us-central2-b -t v4-32 all
  launch/tpu_pod.sh -n my-v4 -z us-central2-b delete
EOF
}

die() {
  echo "error: $*" >&2
  exit 2
}

TPU_NAME="${TPU_NAME:-}"
ZONE="${ZONE:-}"
PROJECT="${PROJECT:-}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-}"
RUNTIME_VERSION="${RUNTIME_VERSION:-}"
CONFIG="${CONFIG:-configs/shapes_rl.py:margrpo}"
WORKDIR="${WORKDIR:-}"
SPOT="${SPOT:-0}"
QUEUED="${QUEUED:-0}"
QR_ID="${QR_ID:-}"
REMOTE_DIR="${REMOTE_DIR:-margrpo_jax}"
REMOTE_PYTHON="${REMOTE_PYTHON:-}"
FOLLOW=0
DRY_RUN="${DRY_RUN:-0}"
LOG_LINES="${LOG_LINES:-40}"
LOG_WORKER="${LOG_WORKER:-0}"
COMMAND=""
EXTRA=()

need_value() {
  [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see -h)"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --config.*) EXTRA+=("$1"); shift ;;
    --) shift; EXTRA+=("$@"); break ;;
    -n|--name) need_value "$@"; TPU_NAME="$2"; shift 2 ;;
    --name=*) TPU_NAME="${1#*=}"; shift ;;
    -z|--zone) need_value "$@"; ZONE="$2"; shift 2 ;;
    --zone=*) ZONE="${1#*=}"; shift ;;
    -p|--project) need_value "$@"; PROJECT="$2"; shift 2 ;;
    --project=*) PROJECT="${1#*=}"; shift ;;
    -t|--accelerator-type) need_value "$@"; ACCELERATOR_TYPE="$2"; shift 2 ;;
    --accelerator-type=*) ACCELERATOR_TYPE="${1#*=}"; shift ;;
    -r|--runtime-version) need_value "$@"; RUNTIME_VERSION="$2"; shift 2 ;;
    --runtime-version=*) RUNTIME_VERSION="${1#*=}"; shift ;;
    -c|--config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --config=*) CONFIG="${1#*=}"; shift ;;
    -w|--workdir) need_value "$@"; WORKDIR="$2"; shift 2 ;;
    --workdir=*) WORKDIR="${1#*=}"; shift ;;
    --remote-dir) need_value "$@"; REMOTE_DIR="$2"; shift 2 ;;
    --remote-dir=*) REMOTE_DIR="${1#*=}"; shift ;;
    --spot) SPOT=1; shift ;;
    --queued) QUEUED=1; shift ;;
    -f|--follow) FOLLOW=1; shift ;;
    create|setup|run|logs|stop|fetch|delete|all)
      [[ -z "$COMMAND" ]] || die "two commands given ($COMMAND and $1)"
      COMMAND="$1"; shift ;;
    *) die "unknown argument '$1' (see -h; margrpo_jax overrides start with --config.)" ;;
  esac
done

[[ -n "$COMMAND" ]] || { usage >&2; exit 2; }
[[ -n "$TPU_NAME" ]] || die "the TPU name is required (-n NAME or TPU_NAME=...)"
[[ -n "$ZONE" ]] || die "the zone is required (-z ZONE or ZONE=...)"
QR_ID="${QR_ID:-${TPU_NAME}-qr}"
WORKDIR="${WORKDIR:-runs/${TPU_NAME}}"
JAX_VERSION="${JAX_VERSION:-$(sed -n 's/^jax==\([^[:space:]]*\).*/\1/p' requirements.txt)}"
[[ -n "$JAX_VERSION" ]] || die "no jax==VERSION pin in requirements.txt; set JAX_VERSION"
LOCAL_LOGS="runs/tpu/${TPU_NAME}"

GFLAGS=(--zone="$ZONE")
[[ -z "$PROJECT" ]] || GFLAGS+=(--project="$PROJECT")
SSH_EXTRA=()
[[ -z "${SSH_FLAGS:-}" ]] || read -r -a SSH_EXTRA <<< "$SSH_FLAGS"

# Print a command (shell-quoted), then run it unless DRY_RUN=1.
run_cmd() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  [[ "$DRY_RUN" == 1 ]] || "$@"
}

# A read-only query: printed to stderr, skipped (fails) under DRY_RUN=1; its stdout is for the caller, its
# stderr (NOT_FOUND and the like) is dropped.
query() {
  { printf '+'; printf ' %q' "$@"; printf '\n'; } >&2
  [[ "$DRY_RUN" != 1 ]] || return 1
  "$@" 2>/dev/null
}

default_runtime() {
  case "$1" in
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v5litepod-*|v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v2-*|v3-*|v4-*) echo "tpu-ubuntu2204-base" ;;
    *) return 1 ;;
  esac
}

tpu_state() {  # prints the node's state (READY, CREATING, PREEMPTED, ...); fails when there is no node
  query gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GFLAGS[@]}" --format='value(state)'
}

qr_state() {  # prints the queued resource's state; fails when there is none
  query gcloud compute tpus queued-resources describe "$QR_ID" "${GFLAGS[@]}" --format='value(state.state)'
}

# Run a shell script on all workers at once (gcloud runs --worker=all in parallel).
on_all_workers() {
  run_cmd gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GFLAGS[@]}" "${SSH_EXTRA[@]}" --worker=all --command="$1"
}

# The variables the remote scripts below read, as one line of shell assignments (no trailing newline:
# callers join the pieces with $'\n', since $(...) would drop it anyway).
remote_env() {
  printf 'REMOTE_DIR=%q; JAX_VERSION=%q; REMOTE_PYTHON=%q' "$REMOTE_DIR" "$JAX_VERSION" "$REMOTE_PYTHON"
}

cmd_create() {
  local state
  if state="$(tpu_state)"; then
    echo "TPU $TPU_NAME exists (state $state); reusing it."
    case "$state" in
      READY|CREATING) ;;
      *) echo "warning: $TPU_NAME is $state; a preempted or stopped slice must be deleted and created again" \
           "(launch/tpu_pod.sh ... delete)." >&2 ;;
    esac
    return 0
  fi
  [[ -n "$ACCELERATOR_TYPE" ]] || die "create needs the accelerator type (-t v4-32, v5litepod-16, v5p-64, v6e-16...)"
  if [[ -z "$RUNTIME_VERSION" ]]; then
    RUNTIME_VERSION="$(default_runtime "$ACCELERATOR_TYPE")" \
      || die "no default runtime version for '$ACCELERATOR_TYPE'; pass -r VERSION"
  fi
  local spot=()
  [[ "$SPOT" != 1 ]] || spot=(--spot)
  if [[ "$QUEUED" == 1 ]]; then
    if state="$(qr_state)"; then
      echo "queued resource $QR_ID exists (state $state)."
    else
      run_cmd gcloud compute tpus queued-resources create "$QR_ID" "${GFLAGS[@]}" --node-id="$TPU_NAME" \
        --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" "${spot[@]}"
    fi
    [[ "$DRY_RUN" != 1 ]] || return 0
    echo "waiting for queued resource $QR_ID to become ACTIVE (Ctrl-C stops waiting, not the request)..."
    while true; do
      state="$(qr_state || true)"
      case "$state" in
        ACTIVE) echo "$QR_ID is ACTIVE."; break ;;
        FAILED|SUSPENDED|SUSPENDING) die "queued resource $QR_ID is $state (describe it with gcloud for details)" ;;
        *) echo "  $(date +%H:%M:%S) ${state:-unknown}"; sleep 60 ;;
      esac
    done
  else
    run_cmd gcloud compute tpus tpu-vm create "$TPU_NAME" "${GFLAGS[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" "${spot[@]}"
  fi
}

# The working tree (tracked files + untracked files git does not ignore, so uncommitted edits travel too;
# .venv/, runs/ etc. are ignored) as a tarball.
make_tarball() {
  local out="$1"
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    echo "+ git ls-files -co --exclude-standard | tar -czf $out -T -"
    [[ "$DRY_RUN" == 1 ]] && return 0
    local f files=()
    while IFS= read -r -d '' f; do
      [[ -e "$f" ]] && files+=("$f")  # skip tracked files deleted in the working tree
    done < <(git ls-files -z -co --exclude-standard)
    printf '%s\0' "${files[@]}" | tar -czf "$out" --null -T -
  else
    echo "+ tar -czf $out --exclude=.venv --exclude=runs ... ."
    [[ "$DRY_RUN" == 1 ]] && return 0
    tar -czf "$out" --exclude=./.venv --exclude=./runs --exclude=./workdirs --exclude=./.git \
      --exclude='__pycache__' --exclude='*.egg-info' .
  fi
}

cmd_setup() {
  local tmp tarball
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2064  # expand $tmp now
  trap "rm -rf '$tmp'" EXIT
  tarball="$tmp/margrpo_jax.tar.gz"
  make_tarball "$tarball"
  run_cmd gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:margrpo_jax.tar.gz" "${GFLAGS[@]}" \
    "${SSH_EXTRA[@]}" --worker=all
  local script
  script="$(remote_env)"$'\n'"$(cat <<'EOF'
set -euo pipefail
cd ~ && mkdir -p "$REMOTE_DIR" && cd "$REMOTE_DIR"
rm -rf margrpo_jax configs launch tests benchmarks  # old code; .venv/, runs/ and logs/ stay
tar -xzf ~/margrpo_jax.tar.gz
PY="$REMOTE_PYTHON"
if [ -z "$PY" ]; then
  for c in python3.13 python3.12 python3.11 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      PY="$c"; break
    fi
  done
fi
if [ -z "$PY" ]; then  # the TPU images are Ubuntu 22.04 (python 3.10); the pins need 3.11+
  echo "$(hostname): installing python3.11 from apt"
  sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
  sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3.11 python3.11-venv
  PY=python3.11
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements.txt
.venv/bin/pip install -q "jax[tpu]==$JAX_VERSION"
.venv/bin/pip install -q --no-deps -e .
echo "$(hostname): installed in $PWD/.venv ($(.venv/bin/python --version))"
EOF
)"
  on_all_workers "$script"
  # Check: all workers join one jax.distributed job (as the real run does) and print the global device count.
  on_all_workers "cd ~ && cd $(printf '%q' "$REMOTE_DIR") && .venv/bin/python -c 'import jax; \
jax.distributed.initialize(); print(jax.process_index(), \"of\", jax.process_count(), \"hosts:\", \
jax.device_count(), \"devices\")'"
}

cmd_run() {
  local cmdline script
  cmdline="$(printf '%q ' .venv/bin/python -m margrpo_jax.main "--config=$CONFIG" "--workdir=$WORKDIR" \
    --config.parallel.distributed=True "${EXTRA[@]}")"
  if [[ "$WORKDIR" == *://* && "$WORKDIR" != gs://* ]]; then
    echo "error: workdir $WORKDIR: only gs:// URLs are supported (or a folder every worker shares)." >&2
    return 2
  fi
  if [[ "$WORKDIR" != gs://* ]]; then
    echo "note: workdir $WORKDIR must be shared by all workers on a multi-host slice (an NFS mount, or use" \
      "gs://BUCKET/run): checkpoints are written collectively." >&2
  fi
  script="$(remote_env)"$'\n'"CMDLINE=$(printf '%q' "$cmdline")"$'\n'"$(cat <<'EOF'
set -euo pipefail
cd ~ && cd "$REMOTE_DIR"
mkdir -p logs
if [ -f logs/run.pid ] && kill -0 "$(cat logs/run.pid)" 2>/dev/null; then
  echo "$(hostname): a job is still running (pid $(cat logs/run.pid)); use the stop command first" >&2
  exit 1
fi
[ ! -f logs/run.log ] || mv logs/run.log "logs/run.$(date +%Y%m%d-%H%M%S).log"
echo "$CMDLINE" > logs/run.cmd
eval "nohup env PYTHONUNBUFFERED=1 $CMDLINE > logs/run.log 2>&1 < /dev/null &"
echo $! > logs/run.pid
echo "$(hostname): started pid $(cat logs/run.pid), log $PWD/logs/run.log"
EOF
)"
  echo "command on every worker: $cmdline"
  on_all_workers "$script"
  echo "started; follow worker 0 with: launch/tpu_pod.sh -n $TPU_NAME -z $ZONE logs -f"
}

num_workers() {
  local ips
  if ips="$(query gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GFLAGS[@]}" \
      --format='value(networkEndpoints[].ipAddress)')"; then
    awk -F';' '{print NF}' <<< "$ips"
  else
    echo "${NUM_WORKERS:-1}"
  fi
}

cmd_logs() {
  local log="$REMOTE_DIR/logs/run.log"
  if [[ "$FOLLOW" == 1 ]]; then
    run_cmd gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GFLAGS[@]}" "${SSH_EXTRA[@]}" --worker="$LOG_WORKER" \
      --command="tail -n $LOG_LINES -F $(printf '%q' "$log")"
    return
  fi
  local n i
  n="$(num_workers)"
  [[ "$DRY_RUN" == 1 ]] || mkdir -p "$LOCAL_LOGS"
  for ((i = 0; i < n; i++)); do
    run_cmd gcloud compute tpus tpu-vm scp "$TPU_NAME:$log" "$LOCAL_LOGS/worker-$i.log" "${GFLAGS[@]}" \
      "${SSH_EXTRA[@]}" --worker="$i" || echo "(no log from worker $i)"
  done
  [[ "$DRY_RUN" != 1 ]] || return 0
  for ((i = 0; i < n; i++)); do
    [[ -f "$LOCAL_LOGS/worker-$i.log" ]] || continue
    echo "===== worker $i ($LOCAL_LOGS/worker-$i.log) ====="
    tail -n "$LOG_LINES" "$LOCAL_LOGS/worker-$i.log"
  done
}

cmd_stop() {
  local script
  script="$(remote_env)"$'\n'"$(cat <<'EOF'
cd ~ && cd "$REMOTE_DIR" || exit 0
if [ -f logs/run.pid ] && kill -0 "$(cat logs/run.pid)" 2>/dev/null; then
  pid="$(cat logs/run.pid)"
  kill "$pid"
  for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done  # the step finishes, then a save
  if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
  echo "$(hostname): stopped pid $pid"
else
  echo "$(hostname): no job running"
fi
EOF
)"
  on_all_workers "$script"
}

cmd_fetch() {
  if [[ "$WORKDIR" == gs://* ]]; then
    echo "the workdir is on GCS; copy it with: gcloud storage cp -r $WORKDIR $LOCAL_LOGS/"
    return
  fi
  local src="$WORKDIR"
  [[ "$src" == /* ]] || src="$REMOTE_DIR/$src"
  [[ "$DRY_RUN" == 1 ]] || mkdir -p "$LOCAL_LOGS"
  run_cmd gcloud compute tpus tpu-vm scp --recurse "$TPU_NAME:$src" "$LOCAL_LOGS/workdir" "${GFLAGS[@]}" \
    "${SSH_EXTRA[@]}" --worker=0
}

cmd_delete() {
  if [[ "$QUEUED" == 1 ]] || qr_state >/dev/null; then
    run_cmd gcloud compute tpus queued-resources delete "$QR_ID" "${GFLAGS[@]}" --force --quiet
  else
    run_cmd gcloud compute tpus tpu-vm delete "$TPU_NAME" "${GFLAGS[@]}" --quiet
  fi
}

case "$COMMAND" in
  create) cmd_create ;;
  setup) cmd_setup ;;
  run) cmd_run ;;
  logs) cmd_logs ;;
  stop) cmd_stop ;;
  fetch) cmd_fetch ;;
  delete) cmd_delete ;;
  all) cmd_create; cmd_setup; cmd_run ;;
esac
