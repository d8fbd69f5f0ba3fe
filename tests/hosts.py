"""Separate hosts on one machine: network namespaces joined by veth pairs to one bridge.

Host i (1-based) is network namespace `xh<tag>-i` with its own stack: interface eth0, address
10.77.<net>.i/24, loopback, and its own host name (a UTS namespace per command, name resolution
through /etc/netns/<ns>/hosts, bound over /etc/hosts in a private mount namespace). The file
system is shared, as a parallel file system is between a cluster's nodes. `limit(i, rate)` puts a token
bucket (`tc qdisc ... tbf`) on both directions of host i's link: a link that is really slow.

Needs root, iproute2 (`ip`, `tc`) and util-linux (`unshare`); `Hosts.start` raises HostsError
naming what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path


class HostsError(RuntimeError):
    pass


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise HostsError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


class Hosts:
    def __init__(self, n: int, tag: str | None = None):
        tag = tag or str(os.getpid() % 100000)
        self.n, self.tag = n, tag
        self.net = 10 + os.getpid() % 240
        self.bridge = f"xb{tag}"
        self.names = [f"xh{tag}-{i}" for i in range(1, n + 1)]  # namespace = host name

    def address(self, i: int) -> str:
        return f"10.77.{self.net}.{i}"

    def start(self) -> "Hosts":
        if os.geteuid() != 0:
            raise HostsError("network-namespace hosts need root (ip netns, veth, tc).")
        for tool in ("ip", "tc", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                raise HostsError(f"{tool} not found: apt-get install iproute2 util-linux")
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "link", "set", self.bridge, "up")
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{self.address(i)} {name}\n" for i, name in enumerate(self.names, 1))
            for i, ns in enumerate(self.names, 1):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", f"xv{self.tag}-{i}", "type", "veth", "peer", "name", "eth0",
                    "netns", ns)
                _sh("ip", "link", "set", f"xv{self.tag}-{i}", "master", self.bridge, "up")
                _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
                Path(f"/etc/netns/{ns}/hosts").write_text(hosts)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for i, ns in enumerate(self.names, 1):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", f"xv{self.tag}-{i}"], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def popen(self, i: int, command: str, env: dict, cwd: Path, log: Path) -> subprocess.Popen:
        """Run a shell command line on host i (its own network and host name)."""
        name = self.names[i - 1]
        # the host's network; its own host name (UTS) and /etc/hosts (a private mount
        # namespace); the rest of the file system, /sys and its cgroups included, as it is
        inner = f"mount --bind /etc/netns/{name}/hosts /etc/hosts && hostname {name} && exec {command}"
        return subprocess.Popen(["nsenter", f"--net=/run/netns/{name}", "unshare", "--uts",
                                 "--mount", "sh", "-c", inner],
                                env=env, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def limit(self, i: int, rate: str) -> None:
        """A token bucket of `rate` (tc syntax: 50mbit) on host i's link, both directions."""
        for cmd in (["ip", "netns", "exec", self.names[i - 1], "tc"], ["tc"]):
            dev = "eth0" if len(cmd) > 1 else f"xv{self.tag}-{i}"
            _sh(*cmd, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "16kb",
                "latency", "200ms")

    def unlimit(self, i: int) -> None:
        """Host i's link at full speed again."""
        for cmd in (["ip", "netns", "exec", self.names[i - 1], "tc"], ["tc"]):
            dev = "eth0" if len(cmd) > 1 else f"xv{self.tag}-{i}"
            subprocess.run([*cmd, "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def rx_bytes(self, i: int) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.names[i - 1], "cat",
                              "/sys/class/net/eth0/statistics/rx_bytes"], capture_output=True,
                             text=True)
        return int(out.stdout or 0)


SLURM_CONF = """# a Slurm cluster of the namespace hosts (tests/hosts.py): slurmctld on host 1, a slurmd each
ClusterName=exahosts
SlurmctldHost={ctld}({ctld_addr})
Include {base}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
{nodes}
PartitionName=hosts Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@contextlib.contextmanager
def slurm_on(hosts: Hosts, directory: Path, env: dict, timeout_s: float = 30.0):
    """slurmctld on host 1 and one slurmd per host (munge: this machine's, through its socket);
    yields the environment (SLURM_CONF) under which srun on a host uses this cluster."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "state").mkdir(exist_ok=True)
    nodes = "\n".join(f"NodeName={name} NodeAddr={hosts.address(i)} CPUs=4 State=UNKNOWN"
                      for i, name in enumerate(hosts.names, 1))
    conf = directory / "slurm.conf"
    base = Path(__file__).resolve().parent / "slurm" / "base.conf"
    conf.write_text(SLURM_CONF.format(ctld=hosts.names[0], ctld_addr=hosts.address(1),
                                      dir=directory, nodes=nodes, base=base))
    env = {**env, "SLURM_CONF": str(conf)}
    daemons = [hosts.popen(1, f"slurmctld -D -i -f {conf}", env, directory,
                           directory / "slurmctld.out")]
    daemons += [hosts.popen(i, f"slurmd -D -f {conf} -N {name}", env, directory,
                            directory / f"slurmd-{i}.out") for i, name in enumerate(hosts.names, 1)]
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            probe = hosts.popen(1, "sinfo -h -o %t", env, directory, directory / "sinfo.out")
            probe.wait(timeout_s)
            states = (directory / "sinfo.out").read_text().split()
            if states and all(s == "idle" for s in states):
                break
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                raise HostsError(f"the hosts' Slurm is not up after {timeout_s:.0f} s (nodes "
                                 f"{states}); see {directory}/*.out")
            time.sleep(0.2)
        yield env
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            try:
                d.wait(15)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()


def quote(words) -> str:
    return " ".join(shlex.quote(w) for w in words)
