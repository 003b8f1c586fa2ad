#!/usr/bin/env bash
# cluster.sh: a private single-node SLURM cluster on localhost for tests/workflow/test_slurm.py
# (Debian 12 packages, root, no systemd). Everything lives in one directory: its own munged
# socket and key, slurm.conf/gres.conf, state, logs and pid files, on free ports, so it never
# touches /etc/slurm or a cluster someone else runs on this machine. Clients find it through
# SLURM_CONF (written to DIR/env).
#
#   cluster.sh install      apt-get install slurmctld slurmd slurm-client munge (if missing; ~6 s)
#   cluster.sh start DIR    start munged, slurmctld, slurmd; wait until the node is idle;
#                           `source DIR/env` then points SLURM clients (and srun in jobs) at it
#   cluster.sh stop DIR     stop the daemons whose pid files are in DIR (only those PIDs)
#
# Knobs (environment):
#   SLURM_FAKE_GPUS=8        GRES gpu on the node: character devices (major 195) under DIR, which
#                            SLURM only stat()s; jobs get CUDA_VISIBLE_DEVICES for them
#   SLURM_NODE_CPUS=64       CPUs the node advertises and SLURM_NODE_MEM_MB=1000000 its memory;
#                            with SlurmdParameters=config_overrides slurmd reports the configured
#                            values, so the real profile's resource requests (cpus_per_task: 64,
#                            mem_mb: 480000) are schedulable on a 2-core machine (nothing enforces
#                            them: no cgroups)
#   SLURM_MIN_JOB_AGE=3600   seconds a finished job stays in squeue (the plugin's squeue status
#                            needs >= 3 x slurm-init-seconds-before-status-checks)
#   SLURM_KILL_WAIT=5        seconds between the SIGTERM of a requeue, preemption or scancel (to
#                            every process of every step, the batch shell included) and SIGKILL:
#                            the stopping job's grace (SLURM's default is 30)
#
# Settings found necessary on SLURM 22.05 (Debian bookworm) with snakemake-executor-plugin-slurm
# 2.8.0: GPUs need File= char devices (file-less GPUs are dropped, plain files give an empty
# CUDA_VISIBLE_DEVICES); accounting is off (no slurmdbd), so the profile must poll with squeue
# and MinJobAge must keep finished jobs visible; proctrack/linuxproc + task/none need no cgroups.
set -euo pipefail

cmd=${1:-}
DIR=${2:-}
log() { printf '[cluster.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
PKGS=(slurmctld slurmd slurm-client munge)

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop_pidfile() {  # stop the process whose pid is in $1, and only that one
  if pid_alive "$1"; then
    local p; p=$(cat "$1"); kill "$p" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$p" 2>/dev/null && kill -9 "$p" 2>/dev/null || true
  fi
  rm -f "$1"
}

install_pkgs() {
  [[ $(id -u) == 0 ]] || die "must run as root"
  local missing=() p
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [[ ${#missing[@]} == 0 ]] && return 0
  log "installing ${missing[*]}"
  # maintainer scripts must not try to start services (no systemd); keep an existing policy file
  local made_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  [[ $made_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d
  return 0
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start() {
  [[ $(id -u) == 0 ]] || die "must run as root"
  local b; for b in slurmctld slurmd munged sinfo sbatch; do command -v $b >/dev/null || die "$b not installed (cluster.sh install)"; done
  mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd); chmod 0755 "$DIR"
  runuser -u munge -- test -x "$DIR" || die "$DIR must be reachable by user munge (no 0700 parent dirs)"
  local gpus=${SLURM_FAKE_GPUS:-8} cpus=${SLURM_NODE_CPUS:-64} mem=${SLURM_NODE_MEM_MB:-1000000}
  local node; node=$(hostname -s)
  mkdir -p "$DIR"/{state,spool,log,run,gpu}

  # munge: a private daemon (user munge) with its own socket and a fresh key
  local M=$DIR/munge
  mkdir -p "$M"; chmod 0755 "$M"   # munged: socket dir must be world-executable
  [[ -s $M/munge.key ]] || dd if=/dev/urandom of="$M/munge.key" bs=1024 count=1 status=none
  chmod 0400 "$M/munge.key"; chown -R munge:munge "$M"
  if ! pid_alive "$M/munged.pid"; then
    runuser -u munge -- munged --socket="$M/munge.socket" --key-file="$M/munge.key" \
      --pid-file="$M/munged.pid" --log-file="$M/munged.log" --seed-file="$M/munged.seed"
  fi
  for _ in $(seq 50); do munge -S "$M/munge.socket" -n 2>/dev/null | unmunge -S "$M/munge.socket" >/dev/null 2>&1 && break; sleep 0.1; done
  munge -S "$M/munge.socket" -n | unmunge -S "$M/munge.socket" >/dev/null || die "munged does not work ($M/munged.log)"

  # fake GPUs: character devices with the NVIDIA major number
  local gres_node="" gres_types=""
  if (( gpus > 0 )); then
    for i in $(seq 0 $((gpus - 1))); do
      [[ -c $DIR/gpu/nvidia$i ]] || { rm -f "$DIR/gpu/nvidia$i"; mknod "$DIR/gpu/nvidia$i" c 195 "$i"; }
    done
    printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/gpu/nvidia[0-%d]\n' "$node" "$DIR" $((gpus - 1)) > "$DIR/gres.conf"
    gres_node=" Gres=gpu:$gpus"; gres_types="GresTypes=gpu"
  else
    : > "$DIR/gres.conf"
  fi

  local ctld_port slurmd_port
  if [[ -f $DIR/ports ]]; then read -r ctld_port slurmd_port < "$DIR/ports"
  else ctld_port=$(free_port); slurmd_port=$(free_port); echo "$ctld_port $slurmd_port" > "$DIR/ports"; fi

  cat > "$DIR/slurm.conf" <<CONF
# generated by tests/workflow/slurm/cluster.sh: one node on loopback, private to $DIR
ClusterName=a2tgpotest
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$M/munge.socket
CryptoType=crypto/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=512
ReturnToService=2
MinJobAge=${SLURM_MIN_JOB_AGE:-3600}
InactiveLimit=0
KillWait=${SLURM_KILL_WAIT:-5}
Waittime=0
SlurmdTimeout=300
SlurmctldTimeout=120
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
PreemptType=preempt/none
$gres_types
NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node CPUs=$cpus RealMemory=$mem$gres_node State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  # Clients find this cluster through SLURM_CONF. The jobstep plugin (0.6.1) removes every
  # SLURM_* variable from the environment of the `srun` it starts inside a job, and a client
  # without SLURM_CONF looks for /etc/slurm/slurm.conf (absent: that would be a shared path), so
  # DIR/bin/srun puts SLURM_CONF back. Real clusters have /etc/slurm or configless slurmd.
  mkdir -p "$DIR/bin"
  printf '#!/bin/sh\nexport SLURM_CONF=%s/slurm.conf\nexec %s "$@"\n' "$DIR" "$(command -v srun)" > "$DIR/bin/srun"
  chmod 0755 "$DIR/bin/srun"
  printf 'export SLURM_CONF=%s/slurm.conf\nexport PATH=%s/bin:$PATH\n' "$DIR" "$DIR" > "$DIR/env"
  export SLURM_CONF=$DIR/slurm.conf

  pid_alive "$DIR/run/slurmctld.pid" || slurmctld
  for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
  scontrol ping 2>/dev/null | grep -q 'is UP' || { tail -20 "$DIR/log/slurmctld.log" >&2; die "slurmctld did not come up"; }
  pid_alive "$DIR/run/slurmd.pid" || slurmd

  local st=""
  for _ in $(seq 150); do
    st=$(sinfo -h -n "$node" -o '%t' 2>/dev/null | sort -u | head -1 || true)
    case $st in
      idle|mix|alloc|comp) break;;
      down|drain|drng|inval|fail) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true;;
    esac
    sleep 0.2
  done
  case $st in
    idle|mix|alloc|comp) ;;
    *) sinfo -R >&2 || true; tail -20 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2; die "node $node is '$st'";;
  esac
  log "cluster up in $DIR: $(sinfo -h -o '%P %a %D %t %N %c CPUs %G')"
}

stop() {
  [[ -n $DIR && -d $DIR ]] || return 0
  stop_pidfile "$DIR/run/slurmd.pid"
  stop_pidfile "$DIR/run/slurmctld.pid"
  stop_pidfile "$DIR/munge/munged.pid"
  log "stopped ($DIR)"
}

case $cmd in
  install) install_pkgs;;
  start) [[ -n $DIR ]] || die "usage: cluster.sh start DIR"; start;;
  stop) stop;;
  *) echo "usage: cluster.sh install | start DIR | stop DIR" >&2; exit 2;;
esac
