#!/usr/bin/env bash
# A real Slurm on this machine, for the tests that submit with sbatch and launch with srun:
# munge, slurmctld and slurmd, one node (this host), written and started by this script, as root.
#
#   tests/slurm/start-slurm.sh            start what is not running; print the config's path
#   tests/slurm/start-slurm.sh --install  first `apt-get install slurm-wlm munge iproute2` (Debian)
#
# tests/launched.py's `slurm` fixture runs it (with --install as root where apt-get is); a user
# other than root gets the config's path where root started this Slurm already, else exit 2.
#
# The configuration differs from a centre's only where one machine needs it: tests/slurm/base.conf
# (copied to /etc/slurm/exatrain-base.conf), the node is this host (its CPU count overridden), and
# eight stand-in GPUs (empty files under /run/exagpu: no device behind them) so that Slurm's
# GPU requests (--gpus-per-node) are accepted and counted and a GPU batch script can be submitted;
# the ranks still find no CUDA and train on CPUs with gloo. AuthInfo=cred_expire=5: a requeued
# job is held cred_expire + 1 s before it may start again (121 s by default), which a requeue
# test would otherwise wait out; sched_interval=1 starts it within a second after that.
set -euo pipefail
# one at a time: the suite's workers (pytest-xdist) each run it as their session starts, and a
# second must not rewrite the configuration or restart a daemon under the first one's jobs.
# Every daemon (and apt-get, whose scripts may start one) is started with fd 9 closed: a daemon
# that kept it open would hold the lock for its lifetime, and the next caller would wait forever.
exec 9>>"/tmp/exatrain-start-slurm-$(id -u).lock"
flock 9

if [[ "${1:-}" == "--install" ]]; then
  export DEBIAN_FRONTEND=noninteractive
  # and iproute2 (ip, tc) for tests/test_hosts.py's network-namespace hosts
  command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v tc >/dev/null || \
    { apt-get update -qq 9>&- && apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
        slurm-wlm munge iproute2 >/dev/null 9>&-; }   # (the lock: another apt-get on the machine)
fi
for exe in munged slurmctld slurmd sbatch srun scontrol; do
  if ! command -v "$exe" >/dev/null; then
    echo "start-slurm: $exe not found. Install Slurm and munge (as root on Debian/Ubuntu:" \
         "apt-get install slurm-wlm munge, or run tests/slurm/start-slurm.sh --install)." >&2
    exit 2
  fi
done
conf=/etc/slurm/slurm.conf
header="# written by exatrain's tests/slurm/start-slurm.sh"
if [[ $(id -u) != 0 ]]; then
  # another user's tests: enough where root started this script's Slurm already
  state=$(sinfo -h -n "$(hostname -s)" -o %t 2>/dev/null || true)
  if [[ "$(head -1 $conf 2>/dev/null)" == "$header" && $state =~ ^(idle|mix|alloc)$ ]]; then
    echo "$conf"
    exit 0
  fi
  echo "start-slurm: Slurm is not running with this script's configuration, and starting it" \
       "needs root (it writes /etc/slurm/slurm.conf and starts daemons)." >&2
  exit 2
fi

host=$(hostname -s)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/log/munge \
         /var/lib/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- munged 9>&-
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

want=$(cat <<CONF
$header
ClusterName=exatrain
SlurmctldHost=$host(127.0.0.1)
Include /etc/slurm/exatrain-base.conf
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=1
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
MinJobAge=60
KillWait=10
GresTypes=gpu
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
)
gres="AutoDetect=off
Name=gpu File=/run/exagpu/gpu[0-7]"
mkdir -p /run/exagpu && touch /run/exagpu/gpu{0..7}
base="$(cat "$(dirname "$0")/base.conf")"
if [[ ! -f $conf ]] || [[ "$(cat $conf)" != "$want" ]] || [[ "$(cat /etc/slurm/gres.conf 2>/dev/null)" != "$gres" ]] \
    || [[ "$(cat /etc/slurm/exatrain-base.conf 2>/dev/null)" != "$base" ]]; then
  echo "$base" > /etc/slurm/exatrain-base.conf
  echo "$want" > $conf
  echo "$gres" > /etc/slurm/gres.conf
  pkill -F /run/slurmctld.pid 2>/dev/null || true
  pkill -F /run/slurmd.pid 2>/dev/null || true
  sleep 1
fi
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
alive /run/slurmctld.pid || slurmctld 9>&-
alive /run/slurmd.pid || slurmd 9>&-
for _ in $(seq 100); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
  [[ $state == idle || $state == mix || $state == alloc ]] && break
  [[ $state == down* || $state == drain* ]] && scontrol update nodename="$host" state=resume 2>/dev/null || true
  sleep 0.2
done
if [[ ! $state =~ ^(idle|mix|alloc)$ ]]; then
  echo "start-slurm: node $host is '${state:-not known}' after 20 s; see /var/log/slurm/*.log" >&2
  tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
  exit 1
fi
echo "$conf"
