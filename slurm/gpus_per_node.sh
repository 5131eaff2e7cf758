# Ranks per torchrun agent from whichever GPU request Slurm got; sourced by slurm/train.sbatch
# (and by tests/launch/test_sbatch_env.py, which runs it with made-up environments; no Slurm needed).
#
#   gpus_per_node     GPUs allocated per node: 0 when none were requested; on stderr one line and
#                     status 2 when GPUs were requested but their number cannot be derived
#   ranks_per_agent   NPROC_PER_NODE when set; else the GPUs per node divided among the node's
#                     agents (SLURM_NTASKS_PER_NODE, default 1); 1 on a node without GPUs
#
# Where the count comes from, first that says something:
#   SLURM_GPUS_ON_NODE                       "4" (Slurm sets it for any way of asking for GPUs)
#   SLURM_GPUS_PER_NODE                      --gpus-per-node: "4", "h100:4", "a100:2,v100:2"
#   SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES     the allocated devices: "0,1,2,3" (or GPU UUIDs)
#   SLURM_JOB_GRES, SLURM_GRES, SBATCH_GRES, SLURM_TRES_PER_NODE
#                                            --gres: "gpu:4", "gpu:a100:4", "gres/gpu:4", "gpu" (= 1)
#   SLURM_GPUS (--gpus, for the whole job)   divided by SLURM_JOB_NUM_NODES when it divides evenly

_GPU_VARS=(SLURM_GPUS_ON_NODE SLURM_GPUS_PER_NODE SLURM_JOB_GPUS CUDA_VISIBLE_DEVICES SLURM_JOB_GRES SLURM_GRES
           SBATCH_GRES SLURM_TRES_PER_NODE SLURM_GPUS SLURM_JOB_NUM_NODES)

# Sum of the GPU counts in a --gres / TRES list ("gpu:a100:4(S:0-1),nic:1" -> 4); nothing when
# the list names no GPU; status 1 when it names one without a readable count.
_gres_gpus() {
  local item total=0 found=0
  local -a items
  IFS=',' read -r -a items <<< "$1"
  for item in "${items[@]}"; do
    item=${item%%(*}                           # "(S:0-1)" / "(IDX:0-3)" suffixes
    item=${item#gres/}; item=${item#gres:}     # TRES form "gres/gpu:4"
    [[ $item == gpu || $item == gpu[:=]* ]] || continue
    found=1
    if [[ $item == gpu ]]; then
      total=$(( total + 1 ))                       # --gres=gpu means one GPU
    elif [[ $item =~ ^gpu[:=]([A-Za-z0-9_.-]+[:=])?([0-9]+)$ ]]; then
      total=$(( total + 10#${BASH_REMATCH[2]} ))
    elif [[ $item =~ ^gpu:[A-Za-z][A-Za-z0-9_.-]*$ ]]; then
      total=$(( total + 1 ))                       # --gres=gpu:a100: one GPU of that type
    else
      return 1
    fi
  done
  (( found )) && echo "$total"
  return 0
}

# Sum of the counts in SLURM_GPUS_PER_NODE ("4", "h100:4", "a100:2,v100:2").
_typed_counts() {
  local item total=0
  local -a items
  IFS=',' read -r -a items <<< "$1"
  for item in "${items[@]}"; do
    [[ $item =~ ^([A-Za-z0-9_.-]+:)?([0-9]+)$ ]] || return 1
    total=$(( total + 10#${BASH_REMATCH[2]} ))
  done
  echo "$total"
}

# Number of entries of a device list ("0,1,3" or UUIDs); nothing for an empty or "no device" one.
_device_list() {
  local list=$1
  [[ -z $list || $list == NoDevFiles || $list == -1 ]] && return 0
  local -a items
  IFS=',' read -r -a items <<< "$list"
  echo "${#items[@]}"
}

_gpus_fail() {
  local v shown=()
  for v in "${_GPU_VARS[@]}"; do
    [[ -n ${!v:-} ]] && shown+=("$v='${!v}'")
  done
  echo "memtrain: error: GPUs were requested but their number per node cannot be derived from" \
       "${shown[*]:-no Slurm GPU variable} (read: ${_GPU_VARS[*]}); set NPROC_PER_NODE" >&2
  return 2
}

gpus_per_node() {
  local n v requested=0
  if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    [[ $SLURM_GPUS_ON_NODE =~ ^[0-9]+$ ]] && { echo $(( 10#$SLURM_GPUS_ON_NODE )); return 0; }
    requested=1
  fi
  if [[ -n ${SLURM_GPUS_PER_NODE:-} ]]; then
    n=$(_typed_counts "$SLURM_GPUS_PER_NODE") && { echo "$n"; return 0; }
    requested=1
  fi
  for v in SLURM_JOB_GPUS CUDA_VISIBLE_DEVICES; do
    n=$(_device_list "${!v:-}")
    [[ -n $n ]] && { echo "$n"; return 0; }
  done
  for v in SLURM_JOB_GRES SLURM_GRES SBATCH_GRES SLURM_TRES_PER_NODE; do
    [[ -n ${!v:-} ]] || continue
    if n=$(_gres_gpus "${!v}"); then
      [[ -n $n ]] && { echo "$n"; return 0; }
    else
      requested=1
    fi
  done
  if [[ -n ${SLURM_GPUS:-} ]]; then
    local nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    n=$(_typed_counts "$SLURM_GPUS") || n=
    if [[ -n $n && $nodes =~ ^[1-9][0-9]*$ ]] && (( n % nodes == 0 )); then
      echo $(( n / nodes ))
      return 0
    fi
    requested=1
  fi
  (( requested )) && { _gpus_fail; return 2; }
  echo 0
}

ranks_per_agent() {
  if [[ -n ${NPROC_PER_NODE:-} ]]; then
    [[ $NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]] || {
      echo "memtrain: error: NPROC_PER_NODE='$NPROC_PER_NODE' is not a positive integer" >&2; return 2; }
    echo "$NPROC_PER_NODE"
    return 0
  fi
  local gpus agents=${SLURM_NTASKS_PER_NODE:-1}
  gpus=$(gpus_per_node) || return 2
  (( gpus > 0 )) || { echo 1; return 0; }
  agents=${agents%%(*}  # "2(x3)"
  [[ $agents =~ ^[1-9][0-9]*$ ]] || agents=1
  if (( gpus % agents )); then
    echo "memtrain: error: $gpus GPUs per node do not divide among $agents agents per node" \
         "(SLURM_NTASKS_PER_NODE); set NPROC_PER_NODE" >&2
    return 2
  fi
  echo $(( gpus / agents ))
}

# The GPUs of this agent (srun task SLURM_LOCALID) when several agents share a node: `nproc` ids, the agent's
# slice of the node's (CUDA_VISIBLE_DEVICES as Slurm set it for the job, else SLURM_JOB_GPUS, else 0..N-1), as
# a CUDA_VISIBLE_DEVICES value. Without it every agent's LOCAL_RANK 0 would take the node's first GPU. Prints
# nothing when one agent has the node or the node has no GPU.
agent_gpus() {
  local nproc=$1 agents=${SLURM_NTASKS_PER_NODE:-1} id=${SLURM_LOCALID:-0} list n
  agents=${agents%%(*}
  [[ $agents =~ ^[1-9][0-9]*$ ]] && (( agents > 1 )) || return 0
  local -a ids=()
  list=${CUDA_VISIBLE_DEVICES:-${SLURM_JOB_GPUS:-}}
  if [[ -n $list && $list != NoDevFiles && $list != -1 ]]; then
    IFS=',' read -r -a ids <<< "$list"
  else
    n=$(gpus_per_node) || return 2
    (( ${n:-0} > 0 )) || return 0
    mapfile -t ids < <(seq 0 $(( n - 1 )))
  fi
  if (( ${#ids[@]} < agents * nproc )); then
    echo "memtrain: error: $agents agents x $nproc ranks per node need $(( agents * nproc )) GPUs, the node has" \
         "${#ids[@]} (${list:-from the GPU count}); set NPROC_PER_NODE" >&2
    return 2
  fi
  local IFS=,
  echo "${ids[*]:id*nproc:nproc}"
}
