#!/usr/bin/env python3
"""A throwaway Slurm cluster on this machine: a directory -> munged + slurmctld + slurmd(s) -> sbatch.

For trying the sbatch scripts without a cluster, and for tests/test_slurm.py. Everything (keys,
slurm.conf, state, spool, logs, pid files) lives in one directory; nothing under /etc is touched
and no system service is started. Needs root (slurmd runs jobs as the submitting user and Slurm's
daemons refuse other setups without a real installation) and the Debian packages
``slurm-wlm munge`` (``ensure_installed`` installs them with apt-get when it can).

    python scripts/slurm/local_cluster.py up /tmp/slurm [--nodes 2]   # prints `export SLURM_CONF=...`
    export SLURM_CONF=/tmp/slurm/slurm.conf; sbatch ...; squeue; scontrol show job ...
    python scripts/slurm/local_cluster.py down /tmp/slurm

The cluster is deliberately simple: no cgroups (``proctrack/linuxproc``, ``task/none``), no
accounting database (use ``scontrol show job`` / ``squeue``, not ``sacct``), every node has all of
this machine's CPUs (several emulated nodes share them), ``cred_expire=5`` so that a requeued job
becomes eligible again after about 11 s instead of 2 minutes.

Several nodes are ``bsnode1``, ``bsnode2``... at the loopback addresses 127.0.0.2, 127.0.0.3...
(``NodeAddr``; the controller stays on 127.0.0.1), each slurmd on its own port. So that a job
reaches its first node by name, as on a real cluster, the names are added to /etc/hosts when they
do not resolve and the file is writable (one line each, left in place: they only name loopback
addresses); otherwise jobs fall back to the addresses (``cluster.json`` says which).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
QUERY_GRACE_S = 30.0  # how long `wait` retries a failing `scontrol show job` before giving up
APT_PACKAGES = ("slurm-wlm", "slurmctld", "slurmd", "slurm-client", "munge")


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/sbin", "/usr/bin") if (p := Path(d) / name).exists()), None)


def missing_binaries() -> list[str]:
    return [name for name in DAEMONS + CLIENTS if _which(name) is None]


def ensure_installed(install: bool = True) -> str | None:
    """None when Slurm and munge are usable here, else the reason they are not (after trying
    ``apt-get install`` when ``install`` is set, we are root and apt-get exists)."""
    missing = missing_binaries()
    if not missing:
        return None
    if not install:
        return f"missing {', '.join(missing)}"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (f"missing {', '.join(missing)}; install the Debian/Ubuntu packages "
                f"{' '.join(APT_PACKAGES)} (needs root and apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode:
            return f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-500:]}"
    missing = missing_binaries()
    return f"still missing after apt-get install: {', '.join(missing)}" if missing else None


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _resolves(host: str) -> bool:
    try:
        socket.gethostbyname(host)
        return True
    except OSError:
        return False


HOSTS_FILE = Path("/etc/hosts")


def node_address(index: int) -> str:
    """The loopback address of emulated node ``index`` (0-based) of a multi-node cluster."""
    return f"127.0.0.{index + 2}"


def ensure_host_names(names_to_addresses: dict[str, str], hosts: Path = HOSTS_FILE) -> bool:
    """Make every name resolve to its address, appending ``address name`` lines to ``hosts``
    for those that do not resolve yet; False when one resolves elsewhere or cannot be added."""
    missing = {}
    for name, address in names_to_addresses.items():
        try:
            if socket.gethostbyname(name) != address:
                return False
        except OSError:
            missing[name] = address
    if missing:
        try:
            with open(hosts, "a") as f:
                f.writelines(f"{address} {name}  # local_cluster.py\n"
                             for name, address in missing.items())
        except OSError:
            return False
    return all(_resolves(name) for name in missing)


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


class SlurmError(RuntimeError):
    pass


class LocalSlurm:
    """One controller and ``nodes`` slurmd daemons on this machine, all state under ``root``.

    ``start()`` brings it up and waits until every node is idle; ``stop()`` cancels the jobs,
    ends every process that belongs to this cluster (found by its SLURM_CONF) and the daemons.
    ``env`` is the environment for client commands (SLURM_CONF points at this cluster).
    """

    def __init__(self, root: str | os.PathLike, nodes: int = 1, cpus: int | None = None,
                 mem_mb: int | None = None):
        self.root = Path(root).absolute()
        self.nodes = nodes
        self.cpus = cpus or os.cpu_count() or 1
        self.mem_mb = mem_mb or max(256, int(_mem_mb() * 0.9) // max(1, nodes))
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if var != "SLURM_CONF":
                del self.env[var]
        host = socket.gethostname().split(".")[0]
        self.ctld_host = host
        if nodes == 1:
            self.node_names = [host if _resolves(host) else "localhost"]
            self.node_addrs = ["127.0.0.1"]
        else:
            self.node_names = [f"bsnode{i}" for i in range(1, nodes + 1)]
            self.node_addrs = [node_address(i) for i in range(nodes)]
        self.names_resolve = nodes == 1

    # -- configuration ----------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for sub in ("munge", "state", "log", "run", "spool"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o755)  # munged insists on a socket dir that others can traverse
        ctld_port, *node_ports = _free_ports(1 + self.nodes)
        lines = [
            "# Generated by scripts/slurm/local_cluster.py: a throwaway single-machine cluster.",
            f"ClusterName=bubblespec{ctld_port}",
            # Job ids differ between clusters, and so do the rendezvous ports derived from them.
            f"FirstJobId={random.randint(1000, 900000)}",
            f"SlurmctldHost={self.ctld_host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0,sched_interval=1",
            "ReturnToService=2",
            "JobRequeue=1",
            "MailProg=/bin/true",
            "KillWait=10",
            "MinJobAge=3600",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            f"TmpFS={r / 'tmp'}",
        ]
        (r / "tmp").mkdir(exist_ok=True)
        node = (f"CPUs={self.cpus} Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 "
                f"RealMemory={self.mem_mb} State=UNKNOWN")
        if self.nodes == 1:
            name = self.node_names[0]
            addr = "" if name == socket.gethostname().split(".")[0] else " NodeHostname=localhost"
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1{addr} {node}")
        else:
            self.names_resolve = ensure_host_names(dict(zip(self.node_names, self.node_addrs)))
            for name, addr, port in zip(self.node_names, self.node_addrs, node_ports):
                lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr={addr} "
                             f"Port={port} {node}")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                     "OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")
        # No cgroup plugin is configured (proctrack/linuxproc, task/none); slurmd still reads
        # this file, so keep it from mounting or touching anything.
        (r / "cgroup.conf").write_text("CgroupMountpoint=/sys/fs/cgroup\nIgnoreSystemd=yes\n"
                                       "ConstrainCores=no\nConstrainRAMSpace=no\n"
                                       "ConstrainDevices=no\n")
        for name in self.node_names:
            (r / "spool" / name).mkdir(exist_ok=True)
        (r / "cluster.json").write_text(json.dumps({"nodes": self.node_names,
                                                    "addresses": self.node_addrs,
                                                    "names_resolve": self.names_resolve}))

    # -- lifecycle --------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.console", "ab")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env,
                                            start_new_session=True)
        log.close()
        (self.root / "run" / f"{name}.popen.pid").write_text(str(self.procs[name].pid))

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            console = (self.root / "log" / f"{name}.console").read_text(errors="replace")
            raise SlurmError(f"{name} exited with {proc.returncode}: {console.strip()[-2000:]}"
                             + self._log_tail())

    def _log_tail(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            text = f.read_text(errors="replace").strip().splitlines()[-15:]
            out.append(f"\n--- {f.name} ---\n" + "\n".join(text))
        return "".join(out)

    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        missing = missing_binaries()
        if missing:
            raise SlurmError(f"missing {', '.join(missing)}")
        if len(str(self.root)) > 70:
            raise SlurmError(f"{self.root} is too long for the daemons' unix sockets (108 bytes)")
        self._write_config()
        r = self.root
        key = r / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o600)
        # --force: pytest-style 0700 parents of the socket dir are fine, only root uses it.
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}",
                               f"--pid-file={r / 'run' / 'munged.pid'}",
                               f"--log-file={r / 'log' / 'munged.log'}",
                               f"--seed-file={r / 'munge' / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), 10, "munged socket", "munged")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._run(["scontrol", "ping"]).returncode == 0
                   and "UP" in self._run(["scontrol", "ping"]).stdout, timeout, "slurmctld",
                   "slurmctld")
        for name in self.node_names:
            self._spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-f", str(self.conf),
                                           "-N", name])
        self._wait(self._nodes_idle, timeout, "idle nodes",
                   *[f"slurmd-{n}" for n in self.node_names])
        return self

    def _wait(self, cond, timeout: float, what: str, *daemons: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for d in daemons:
                self._check_alive(d)
            if cond():
                return
            time.sleep(0.2)
        raise SlurmError(f"timed out after {timeout:.0f}s waiting for {what}" + self._log_tail())

    def _nodes_idle(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        return all(states.get(n, "").rstrip("*") == "idle" for n in self.node_names)

    def _run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env,
                              timeout=kw.pop("timeout", 30), **kw)

    def _own_pids(self) -> list[int]:
        """Processes of this cluster: Slurm's daemons and step daemons and the jobs' processes
        whose environment points SLURM_CONF at our slurm.conf (a shell that merely exported
        SLURM_CONF is not one of them)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                comm = (d / "comm").read_text().strip()
            except OSError:
                continue
            if marker in env and (comm in ("slurmstepd", "slurmd", "slurmctld")
                                   or any(v.startswith(b"SLURM_JOB_ID=") for v in env)):
                pids.append(int(d.name))
        return pids

    def stop(self, extra_pids=(), cancel: bool | None = None) -> None:
        """Cancel all jobs, end this cluster's processes (by pid), remove nothing on disk."""
        if cancel is None:
            cancel = "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None
        if self.conf.exists() and cancel:
            try:
                self._run(["scancel", "--full", "--quiet", f"--user={os.getuid()}"], timeout=10)
            except (OSError, subprocess.SubprocessError):
                pass
        pids = set(self._own_pids()) | {p.pid for p in self.procs.values() if p.poll() is None}
        pids |= {p for p in extra_pids if _alive(p)}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                for proc in self.procs.values():
                    proc.poll()
                time.sleep(0.1)
            pids = {p for p in pids if _alive(p)}
            if not pids:
                break
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- clients ----------------------------------------------------------------------------
    def sbatch(self, args: list[str], env: dict | None = None, cwd=None) -> int:
        """Submit; returns the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                              env={**self.env, **(env or {})}, cwd=cwd, timeout=30)
        if proc.returncode:
            raise SlurmError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int | str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, StdOut, ...); an array
        task is ``"<array job id>_<index>"``."""
        proc = self._run(["scontrol", "show", "job", "-o", str(job_id)])
        if proc.returncode:
            raise SlurmError(f"scontrol show job {job_id} exited with {proc.returncode}: "
                             f"{(proc.stderr or proc.stdout).strip() or '(no output)'}")
        info = {}
        for tok in proc.stdout.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                info.setdefault(k, v)
        return info

    def wait(self, job_id: int | str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                        "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"),
             timeout: float = 300.0, poll: float = 1.0, until=None) -> dict[str, str]:
        """Poll until the job reaches one of ``states`` (or ``until(info)`` holds); returns its
        info. Raises TimeoutError with the last info and the daemons' log tails.

        A failed ``scontrol show job`` is retried for up to ``QUERY_GRACE_S``: the controller
        can refuse a query for a moment (a requeue in progress holds its job locks, and on a
        2-core machine under load the reply can come late), which says nothing about the job."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        failing_since = None
        while time.monotonic() < deadline:
            for name in self.procs:
                self._check_alive(name)
            try:
                info = self.job(job_id)
            except SlurmError:
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > QUERY_GRACE_S:
                    raise
                time.sleep(poll)
                continue
            failing_since = None
            if info.get("JobState") in states or (until is not None and until(info)):
                return info
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f}s: "
                           f"{info}" + self._log_tail())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="write the configuration into DIR and start the daemons")
    up.add_argument("dir")
    up.add_argument("--nodes", type=int, default=1)
    up.add_argument("--cpus", type=int, default=None, help="CPUs per node (default: all)")
    up.add_argument("--install", action="store_true", help="apt-get install slurm/munge if missing")
    down = sub.add_parser("down", help="stop the cluster that lives in DIR")
    down.add_argument("dir")
    args = ap.parse_args()
    if args.cmd == "up":
        reason = ensure_installed(install=args.install)
        if reason:
            print(f"local_cluster: {reason}", file=sys.stderr)
            return 1
        cluster = LocalSlurm(args.dir, nodes=args.nodes, cpus=args.cpus)
        try:
            cluster.start()  # the daemons run in their own sessions and outlive this command
        except SlurmError as err:
            cluster.stop()
            print(f"local_cluster: {err}", file=sys.stderr)
            return 1
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    root = Path(args.dir).absolute()
    cluster = LocalSlurm(root)
    extra = set()
    for pid_file in (root / "run").glob("*.popen.pid"):
        try:
            extra.add(int(pid_file.read_text()))
        except ValueError:
            pass
    cluster.stop(extra_pids=extra, cancel=True)
    print(f"stopped the cluster in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
