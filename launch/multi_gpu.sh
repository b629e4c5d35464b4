#!/usr/bin/env bash
# margrpo_jax on NVIDIA GPUs: one host with several GPUs, or several hosts under SLURM.
#
#   setup:  .venv with requirements.txt + jax[cuda12] at the pinned jax version
#   run:    one process drives every local GPU; the mesh spans them (default: FSDP over all local GPUs)
#   sbatch: submit a multi-host SLURM job (one task per node, all of its GPUs), each task running `srun` below
#   srun:   the per-task body inside an allocation: JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
#           JAX_PROCESS_ID from the SLURM variables, then the job with --config.parallel.distributed=True
#
# Commands are printed before they run; DRY_RUN=1 prints them without running anything.
# Run `launch/multi_gpu.sh -h` for the options.
set -euo pipefail

cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
Usage: launch/multi_gpu.sh [options] COMMAND [--config.KEY=VALUE ...] [-- EXTRA_ARGS ...]

Commands:
  setup    create .venv and install requirements.txt + jax[cuda12]==<the pinned jax version>
  run      single host: one process over all local GPUs (mesh data=1, fsdp=-1, tensor=1 unless set)
  sbatch   multi-host: submit a SLURM job of NODES nodes x GPUS_PER_NODE GPUs that runs `srun` on each node
  srun     (inside a SLURM allocation, one task per node) set the JAX_* variables from SLURM, run the job
           with --config.parallel.distributed=True

Options (each also settable through the environment variable in brackets):
  -c, --config CFG        config [CONFIG] (default configs/shapes_rl.py:margrpo)
  -w, --workdir DIR       workdir [WORKDIR] (default runs/gpu; under SLURM it must be on a filesystem
                          that every node sees, as must this repository and its .venv)
      --data N            mesh axis sizes [MESH_DATA, MESH_FSDP, MESH_TENSOR]; -1 = the remaining devices,
      --fsdp N            and data x fsdp x tensor must equal the global device count.
      --tensor N          Defaults: run: 1, -1, 1 (FSDP over the local GPUs);
                          srun/sbatch: -1, GPUs per node, 1 (FSDP inside a node, data-parallel across nodes)
  -N, --nodes N           sbatch: number of nodes [NODES] (default 2)
  -g, --gpus-per-node N   sbatch: GPUs per node [GPUS_PER_NODE] (default 8)
  -h, --help              this message

Arguments starting with --config. (and everything after --) are passed to margrpo_jax.main unchanged.
Other environment: DRY_RUN=1 (print, do not run), PYTHON (interpreter for setup, python >= 3.11;
default python3), JAX_VERSION (default: the jax pin in requirements.txt), SBATCH_ARGS (extra sbatch flags,
e.g. "--partition=gpu --account=me --time=04:00:00"), COORDINATOR_PORT (default 20000 + job id % 20000),
XLA_PYTHON_CLIENT_MEM_FRACTION (default here 0.90, see below).

GPU memory: JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of each GPU at start-up (JAX's own default
is 0.75); this script raises it to 0.90 for larger batches. Lower it if something else shares the GPU;
XLA_PYTHON_CLIENT_PREALLOCATE=false allocates on demand instead (slower, can fragment). Note that
`--config.mode=plan` with configs/mar.py reports the per-device compiled memory before you allocate.

Examples:
  launch/multi_gpu.sh setup
  launch/multi_gpu.sh run --config.num_iters=200                 # FSDP over all local GPUs
  launch/multi_gpu.sh --data 2 --fsdp 4 run                      # 8 GPUs: 2-way data x 4-way FSDP
  launch/multi_gpu.sh -c configs/mar.py:huge run --config.mode=plan
  SBATCH_ARGS="--partition=gpu --time=02:00:00" launch/multi_gpu.sh -N 4 -g 8 -w /shared/runs/rl sbatch
  DRY_RUN=1 launch/multi_gpu.sh -N 2 sbatch
EOF
}

die() {
  echo "error: $*" >&2
  exit 2
}

CONFIG="${CONFIG:-configs/shapes_rl.py:margrpo}"
WORKDIR="${WORKDIR:-runs/gpu}"
MESH_DATA="${MESH_DATA:-}"
MESH_FSDP="${MESH_FSDP:-}"
MESH_TENSOR="${MESH_TENSOR:-}"
NODES="${NODES:-2}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
PYTHON="${PYTHON:-python3}"
DRY_RUN="${DRY_RUN:-0}"
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
    -c|--config) need_value "$@"; CONFIG="$2"; shift 2 ;;
    --config=*) CONFIG="${1#*=}"; shift ;;
    -w|--workdir) need_value "$@"; WORKDIR="$2"; shift 2 ;;
    --workdir=*) WORKDIR="${1#*=}"; shift ;;
    --data) need_value "$@"; MESH_DATA="$2"; shift 2 ;;
    --fsdp) need_value "$@"; MESH_FSDP="$2"; shift 2 ;;
    --tensor) need_value "$@"; MESH_TENSOR="$2"; shift 2 ;;
    -N|--nodes) need_value "$@"; NODES="$2"; shift 2 ;;
    -g|--gpus-per-node) need_value "$@"; GPUS_PER_NODE="$2"; shift 2 ;;
    setup|run|sbatch|srun)
      [[ -z "$COMMAND" ]] || die "two commands given ($COMMAND and $1)"
      COMMAND="$1"; shift ;;
    *) die "unknown argument '$1' (see -h; margrpo_jax overrides start with --config.)" ;;
  esac
done
[[ -n "$COMMAND" ]] || { usage >&2; exit 2; }

JAX_VERSION="${JAX_VERSION:-$(sed -n 's/^jax==\([^[:space:]]*\).*/\1/p' requirements.txt)}"
[[ -n "$JAX_VERSION" ]] || die "no jax==VERSION pin in requirements.txt; set JAX_VERSION"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"

# Print a command (shell-quoted), then run it unless DRY_RUN=1.
run_cmd() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  [[ "$DRY_RUN" == 1 ]] || "$@"
}

venv_python() {
  if [[ -x .venv/bin/python ]]; then echo .venv/bin/python; else echo python3; fi
}

# GPUs this process can see: CUDA_VISIBLE_DEVICES when set (SLURM sets it), else nvidia-smi's list.
local_gpus() {
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    awk -F, '{print NF}' <<< "$CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L | grep -c '^GPU'
  elif [[ "$DRY_RUN" == 1 ]]; then
    echo "${GPUS_PER_NODE}"
  else
    die "no GPU found (nvidia-smi missing and CUDA_VISIBLE_DEVICES unset)"
  fi
}

mesh_flags() {  # data fsdp tensor
  printf '%s\n' "--config.parallel.mesh.data=$1" "--config.parallel.mesh.fsdp=$2" "--config.parallel.mesh.tensor=$3"
}

cmd_setup() {
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    [[ "$DRY_RUN" == 1 ]] || die "$PYTHON is older than 3.11 (or missing); the pins need 3.11+: set PYTHON=python3.11"
  fi
  [[ -x .venv/bin/python ]] || run_cmd "$PYTHON" -m venv .venv
  run_cmd .venv/bin/pip install -q --upgrade pip
  run_cmd .venv/bin/pip install -q -r requirements.txt
  run_cmd .venv/bin/pip install -q "jax[cuda12]==$JAX_VERSION"
  run_cmd .venv/bin/pip install -q --no-deps -e .
  run_cmd .venv/bin/python -c 'import jax; print(jax.__version__, jax.devices())'
}

cmd_run() {
  local n mesh=()
  n="$(local_gpus)"
  mapfile -t mesh < <(mesh_flags "${MESH_DATA:-1}" "${MESH_FSDP:--1}" "${MESH_TENSOR:-1}")
  echo "single host, $n GPUs, XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION"
  run_cmd "$(venv_python)" -m margrpo_jax.main "--config=$CONFIG" "--workdir=$WORKDIR" "${mesh[@]}" "${EXTRA[@]}"
}

cmd_srun() {
  if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    [[ "$DRY_RUN" == 1 ]] || die "srun runs inside a SLURM allocation (see the sbatch command)"
    echo "(DRY_RUN outside SLURM: placeholder SLURM values)"
  fi
  local head n port ids mesh=()
  if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
    head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  else
    head="${SLURMD_NODENAME:-$(hostname)}"
  fi
  port="${COORDINATOR_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
  n="$(local_gpus)"
  ids="$(seq -s, 0 $((n - 1)))"
  export JAX_COORDINATOR_ADDRESS="${JAX_COORDINATOR_ADDRESS:-$head:$port}"
  export JAX_NUM_PROCESSES="${SLURM_NTASKS:-$NODES}"
  export JAX_PROCESS_ID="${SLURM_PROCID:-0}"
  # One process per node drives all its GPUs: without this, jax's SLURM auto-detection would give each
  # process only the GPU numbered SLURM_LOCALID.
  export JAX_LOCAL_DEVICE_IDS="${JAX_LOCAL_DEVICE_IDS:-$ids}"
  echo "process $JAX_PROCESS_ID of $JAX_NUM_PROCESSES on $(hostname): coordinator $JAX_COORDINATOR_ADDRESS," \
    "local GPUs $JAX_LOCAL_DEVICE_IDS"
  mapfile -t mesh < <(mesh_flags "${MESH_DATA:--1}" "${MESH_FSDP:-$n}" "${MESH_TENSOR:-1}")
  run_cmd "$(venv_python)" -m margrpo_jax.main "--config=$CONFIG" "--workdir=$WORKDIR" \
    --config.parallel.distributed=True "${mesh[@]}" "${EXTRA[@]}"
}

cmd_sbatch() {
  local args=() script forward=()
  [[ -z "${SBATCH_ARGS:-}" ]] || read -r -a args <<< "$SBATCH_ARGS"
  [[ "$DRY_RUN" == 1 ]] || mkdir -p runs/slurm
  # Options the per-node tasks need, forwarded explicitly (srun's environment would carry them too).
  forward=(-c "$CONFIG" -w "$WORKDIR" -g "$GPUS_PER_NODE" -N "$NODES")
  [[ -z "$MESH_DATA" ]] || forward+=(--data "$MESH_DATA")
  [[ -z "$MESH_FSDP" ]] || forward+=(--fsdp "$MESH_FSDP")
  [[ -z "$MESH_TENSOR" ]] || forward+=(--tensor "$MESH_TENSOR")
  script="#!/usr/bin/env bash
#SBATCH --job-name=margrpo_jax
#SBATCH --nodes=$NODES
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=$GPUS_PER_NODE
#SBATCH --output=runs/slurm/%j.out
set -euo pipefail
cd $(printf '%q' "$PWD")
srun --kill-on-bad-exit=1 bash launch/multi_gpu.sh$(printf ' %q' "${forward[@]}") srun$(printf ' %q' -- "${EXTRA[@]}")
"
  printf '+ sbatch'
  [[ ${#args[@]} -eq 0 ]] || printf ' %q' "${args[@]}"
  printf ' <<EOF\n%sEOF\n' "$script"
  [[ "$DRY_RUN" == 1 ]] || sbatch "${args[@]}" <<< "$script"
}

case "$COMMAND" in
  setup) cmd_setup ;;
  run) cmd_run ;;
  srun) cmd_srun ;;
  sbatch) cmd_sbatch ;;
esac
