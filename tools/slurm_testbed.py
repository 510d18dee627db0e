"""A real two-node Slurm cluster on one machine, on loopback addresses only: the test bed of
``tests/slurm`` and a place to try ``hacrl launch --executor slurm`` without a cluster.

    sudo python tools/slurm_testbed.py [--dir /tmp/hacrl-slurm]    # start, print how to use it, Ctrl-C stops

What runs (Debian bookworm packages: ``slurmctld slurmd slurm-client slurmdbd munge mariadb-server``,
all daemons as root, every file under one folder):

- ``munged`` with a fresh key, on its own socket (``AuthInfo=socket=...``);
- MariaDB on 127.0.0.1 (a throw-away data folder) and ``slurmdbd`` in front of it: NeMo-Run reads a
  job's state with ``sacct``, which needs the accounting database;
- ``slurmctld`` on 127.0.0.1 and two ``slurmd -N n1`` / ``slurmd -N n2``, nodes n1 and n2 with
  ``NodeAddr`` 127.0.0.2 and 127.0.0.3 and their own ports, ``ProctrackType=proctrack/linuxproc``,
  ``TaskPlugin=task/none``. Every daemon runs in its own UTS and mount namespace: host name n1, n2
  or hacrl-ctl and an /etc/hosts that names them all, so a task on n2 sees host n2 and resolves n1.
  slurmctld and slurmdbd bind their host name's address (``NoCtldInAddrAny``, ``NoInAddrAny``);
  slurmd and srun listen on the wildcard address (Slurm 22.05 binds either the wildcard or the host
  name's address, and a step calls srun back at the source address of srun's request, which is
  127.0.0.1 for every loopback destination), but every client and daemon sends to 127.0.0.x only;
- a ``TaskProlog`` that gives every task of node k its own Ray temp folder, ``--num-cpus`` and a
  block of ports (``HACRL_RAY_START_ARGS``): two Ray nodes share this machine's /tmp and port space,
  which two real nodes never do.

Jobs see ``SLURM_CONF``; clients run with ``env SLURM_CONF=<dir>/etc/slurm.conf`` (:meth:`SlurmBed.env`).
:meth:`SlurmBed.stop` cancels every job, stops every daemon it started and kills any process left
that still belongs to the bed (a task's environment names its ``SLURM_CONF``, a step daemon holds
files in the bed's folder, a Ray process holds files in its node's Ray folder);
:meth:`SlurmBed.leftovers` lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

NODES = {"n1": "127.0.0.2", "n2": "127.0.0.3"}
CTLD_HOST, CTLD_ADDR = "hacrl-ctl", "127.0.0.1"
ACCOUNT, PARTITION = "hacrl", "hacrl"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server")
BINARIES = ("munged", "slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "sacctmgr", "mariadbd",
            "mariadb-install-db")
RAY_PORT_FLAGS = ("node-manager-port", "object-manager-port", "metrics-export-port", "runtime-env-agent-port",
                  "dashboard-agent-grpc-port", "dashboard-agent-listen-port", "ray-client-server-port", "dashboard-port")
RAY_PORTS_PER_NODE = 32  # RAY_PORT_FLAGS, then min/max-worker-port over the rest
# a job step credential's lifetime, which is also how long Slurm holds a requeued job before it may start
# again (slurm.conf AuthInfo cred_expire; 120 s by default, 2 min 14 s measured): shorter here, ample for a
# step launch on one loaded machine
CRED_EXPIRE_S = 30


class BedError(RuntimeError):
    """The test bed could not start (message names the daemon and its log)."""


def missing_binaries() -> list[str]:
    """The programs of :data:`BINARIES` not on PATH (empty: the packages are installed)."""
    return [b for b in BINARIES if shutil.which(b) is None]


# Ports the bed hands out come from outside the kernel's ephemeral range (what bind(0) and every outgoing
# connection draw from) and above Ray's default worker ports (10002-19999): a port chosen now is bound only
# later (a job's Ray head starts minutes after the bed), and in that window another process on the machine
# takes it only by asking for it by number. Ray binds its servers on the wildcard address, so "free" means
# free on every address.
QUIET_LOW = 20000


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's ephemeral range (``net.ipv4.ip_local_port_range``; Linux's default if unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _free_on_every_address(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def quiet_ports(n: int, consecutive: bool = False) -> list[int]:
    """``n`` distinct TCP ports, free on every address right now, from outside the ephemeral range and above
    Ray's worker ports (see above); ``consecutive``: a run ``p, p+1, ...`` (Ray's worker-port range, or
    ``hacrl launch --per-agent-jobs``, which gives agent i the port ``--ray-port`` + i)."""
    low, high = ephemeral_port_range()
    spans = [(a, b) for a, b in ((QUIET_LOW, low - 1), (high + 1, 65535)) if b - a + 1 >= n]
    if not spans:
        raise BedError(f"no room for {n} ports outside the ephemeral range {low}-{high} above {QUIET_LOW}")
    rng = random.SystemRandom()  # two beds on one machine do not walk the same sequence
    for _ in range(500):
        a, b = rng.choice(spans)
        if consecutive:
            first = rng.randint(a, b - n + 1)
            ports = list(range(first, first + n))
        else:
            ports = rng.sample(range(a, b + 1), n)
        if all(_free_on_every_address(p) for p in ports):
            return ports
    raise BedError(f"no {n} free ports outside the ephemeral range {low}-{high} after 500 tries")


def ray_port_block() -> list[int]:
    """A run of :data:`RAY_PORTS_PER_NODE` consecutive quiet ports: Ray's worker ports are a range
    (``--min-worker-port``..``--max-worker-port``)."""
    return quiet_ports(RAY_PORTS_PER_NODE, consecutive=True)


class SlurmBed:
    """The two-node cluster under ``root`` (see module docstring). Use as a context manager or call
    :meth:`start` / :meth:`stop`."""

    def __init__(self, root: str | Path, *, cpus_per_node: int = 1, ray_cpus: int = 1, nice: int = 0) -> None:
        self.root = Path(root).resolve()
        self.nice = nice  # of the slurmd daemons, hence of every job's processes
        self.cpus_per_node = cpus_per_node
        self.ray_cpus = ray_cpus
        self.conf = self.root / "etc" / "slurm.conf"
        self.hosts_file = self.root / "etc" / "hosts"
        self.log_dir = self.root / "log"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.ray_temp_dirs: list[Path] = []
        self.ray_ports: dict[str, dict[str, int]] = {}  # node -> {`ray start` port flag: port}
        self.ctld_port, self.dbd_port, self.db_port, *node_ports = quiet_ports(3 + len(NODES))
        self.node_ports = dict(zip(NODES, node_ports))

    # -- configuration ------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """This process's environment with ``SLURM_CONF`` pointing at the bed."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        """slurm.conf, slurmdbd.conf (mode 0600, as slurmdbd demands) and the task prolog."""
        for sub in ("etc", "state", "spool", "log", "munge", "db", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._slurm_conf())
        dbd = self.conf.parent / "slurmdbd.conf"
        dbd.write_text(self._dbd_conf())
        dbd.chmod(0o600)
        for node in NODES:
            (self.root / "spool" / node).mkdir(exist_ok=True)
        hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        names = {CTLD_HOST: CTLD_ADDR, **NODES}
        self.hosts_file.write_text(hosts.rstrip("\n") + "\n# the test bed's hosts\n" +
                                   "".join(f"{ip} {name}\n" for name, ip in names.items()))
        prolog = self.root / "etc" / "task_prolog.sh"
        prolog.write_text(self._task_prolog())
        prolog.chmod(0o755)

    def _slurm_conf(self) -> str:
        r = self.root
        nodes = "".join(f"NodeName={n} NodeAddr={ip} NodeHostname={n} Port={self.node_ports[n]} "
                        f"CPUs={self.cpus_per_node} RealMemory=1024 State=UNKNOWN\n" for n, ip in NODES.items())
        return f"""# written by tools/slurm_testbed.py: two nodes on loopback addresses
ClusterName=hacrlbed
SlurmctldHost={CTLD_HOST}({CTLD_ADDR})
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
CommunicationParameters=NoCtldInAddrAny
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
TaskProlog={r}/etc/task_prolog.sh
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=60
SlurmdTimeout=120
InactiveLimit=0
KillWait=30
MinJobAge=600
JobRequeue=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={CTLD_ADDR}
AccountingStoragePort={self.dbd_port}
AccountingStoragePass={self.munge_socket}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{nodes}PartitionName={PARTITION} Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _dbd_conf(self) -> str:
        r = self.root
        return f"""AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
DbdHost={CTLD_HOST}
DbdAddr={CTLD_ADDR}
DbdPort={self.dbd_port}
CommunicationParameters=NoInAddrAny
SlurmUser=root
PidFile={r}/run/slurmdbd.pid
LogFile={r}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost={CTLD_ADDR}
StoragePort={self.db_port}
StorageUser=root
StorageLoc=slurm_acct_db
"""

    def _task_prolog(self) -> str:
        """Per node: a short Ray temp folder (Unix socket paths stay under 107 bytes) and ports of
        its own; ``export`` lines of a TaskProlog become the task's environment."""
        lines = ["#!/bin/bash", "# written by tools/slurm_testbed.py: per-node Ray settings of the test bed",
                 'case "$SLURMD_NODENAME" in']
        tag = os.urandom(3).hex()
        self.ray_temp_dirs = [Path(f"/tmp/hsb{tag}_{node}") for node in NODES]
        self.ray_ports = {}
        for node in NODES:
            block = ray_port_block()
            self.ray_ports[node] = dict(zip(RAY_PORT_FLAGS, block))
            flags = [f"--{f}={p}" for f, p in zip(RAY_PORT_FLAGS, block)]
            flags += [f"--min-worker-port={block[len(RAY_PORT_FLAGS)]}", f"--max-worker-port={block[-1]}"]
            # --temp-dir on every node: a worker node without one uses the head's folder, and two
            # raylets on one machine would share its socket files
            # no log monitor: one Python process less per node while Ray starts (its raylet gives the
            # dashboard agent a fixed 15 s, tight on a loaded machine)
            args = " ".join([f"--temp-dir=/tmp/hsb{tag}_{node}", f"--num-cpus={self.ray_cpus}",
                             "--include-log-monitor=false", *flags])
            lines.append(f'  {node}) echo "export HACRL_RAY_START_ARGS={args}" ;;')
        lines += ["esac", ""]
        return "\n".join(lines)

    # -- daemons ----------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], host: str | None = None) -> None:
        """Start a daemon; with ``host``, in its own UTS and mount namespace whose host name is
        ``host`` and whose /etc/hosts names every node: each daemon and task then sees the machine
        it would on a real cluster, and ``NoInAddrAny`` binds the daemon to that name's address."""
        if host is not None:
            argv = ["unshare", "--uts", "--mount", "--", "sh", "-c",
                    'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"', "sh", host,
                    str(self.hosts_file), *argv]
        log = open(self.log_dir / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=self.env(), cwd=self.root, start_new_session=True)
        log.close()

    def _check_alive(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is not None:
            raise BedError(f"{name} exited with status {p.returncode}; see {self.log_dir}/{name}.out and "
                           f"{self.log_dir}/{name.split('-')[0]}*.log")

    def _wait(self, what: str, ready, timeout_s: float, names: tuple[str, ...]) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name in names:
                self._check_alive(name)
            if time.monotonic() > deadline:
                raise BedError(f"{what} not ready within {timeout_s:g} s; logs in {self.log_dir}")
            time.sleep(0.5)

    def start(self, timeout_s: float = 180.0) -> SlurmBed:
        """Start everything and wait until n1 and n2 are idle; on any failure stop what started."""
        missing = missing_binaries()
        if missing:
            raise BedError(f"not installed: {', '.join(missing)} (apt-get install {' '.join(PACKAGES)})")
        try:
            self.write_config()
            self._start_munge(timeout_s)
            self._start_database(timeout_s)
            self._start_slurm(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self, timeout_s: float) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        m = self.root / "munge"
        # --force: munged refuses to run as root without it; the key and socket are this bed's only
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",
                               f"--log-file={self.log_dir}/munged.log"])
        self._wait("munged", self.munge_socket.exists, timeout_s, ("munged",))

    def _start_database(self, timeout_s: float) -> None:
        data = self.root / "db" / "data"
        out = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                              "--auth-root-authentication-method=normal", "--skip-test-db"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise BedError(f"mariadb-install-db failed: {out.stderr.strip()[-500:]}")
        self._spawn("mariadbd", ["mariadbd", "--no-defaults", f"--datadir={data}", "--user=root",
                                 f"--bind-address={CTLD_ADDR}", f"--port={self.db_port}", "--skip-name-resolve",
                                 f"--socket={self.root}/db/mysqld.sock", f"--pid-file={self.root}/db/mysqld.pid",
                                 f"--log-error={self.log_dir}/mariadb.log", "--innodb-buffer-pool-size=16M",
                                 "--performance-schema=OFF", "--skip-log-bin"])
        self._wait("mariadbd", lambda: _port_open(CTLD_ADDR, self.db_port), timeout_s, ("mariadbd",))
        self._spawn("slurmdbd", ["slurmdbd", "-D"], host=CTLD_HOST)
        self._wait("slurmdbd", lambda: _port_open(CTLD_ADDR, self.dbd_port), timeout_s, ("slurmdbd",))
        for cmd in (["add", "cluster", "hacrlbed"], ["add", "account", ACCOUNT],
                    ["add", "user", "root", f"account={ACCOUNT}", f"defaultaccount={ACCOUNT}"]):
            self.sacctmgr(*cmd)

    def sacctmgr(self, *args: str) -> str:
        out = subprocess.run(["sacctmgr", "-i", *args], capture_output=True, text=True, env=self.env())
        if out.returncode != 0 and "Nothing new added" not in out.stdout + out.stderr:
            raise BedError(f"sacctmgr {' '.join(args)}: {(out.stdout + out.stderr).strip()[-500:]}")
        return out.stdout

    def _start_slurm(self, timeout_s: float) -> None:
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"], host=CTLD_HOST)
        self._wait("slurmctld", lambda: _port_open(CTLD_ADDR, self.ctld_port), timeout_s, ("slurmctld",))
        for node in NODES:
            # nice 0 by default: Ray's raylet gives its dashboard agent a fixed 15 s to start and
            # `ray start` the raylet 30 s to register, which a niced job on a busy machine misses
            self._spawn(f"slurmd-{node}", ["nice", "-n", str(self.nice), "slurmd", "-D", "-N", node], host=node)
        self._wait("nodes n1 and n2 idle", lambda: self.node_states() == {n: "idle" for n in NODES}, timeout_s,
                   tuple(self.procs))

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as ``sinfo -N`` reports it (e.g. idle, alloc, down*)."""
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env())
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    # -- teardown ---------------------------------------------------------------------------------

    def leftovers(self) -> list[int]:
        """PIDs of processes that belong to the bed but are not one of its daemons: tasks (their
        environment names this bed's SLURM_CONF), step daemons (files open in the bed's folder) and
        Ray processes of its nodes (their command line names the node's Ray folder, or they hold
        files in it: a Ray agent or worker that set its process title (``ray::RuntimeEnvAgent``)
        may have overwritten what /proc shows of its command line and environment, but its log
        files stay open). A daemon's own children (slurmctld's slurmscriptd) are the daemon's."""
        ours = {p.pid for p in self.procs.values() if p.poll() is None}
        conf = f"SLURM_CONF={self.conf}".encode()
        temps = [str(t).encode() for t in self.ray_temp_dirs]
        found = []
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            if pid == os.getpid() or _descends_from(pid, ours):  # a daemon or its helper (slurmscriptd)
                continue
            if (_environ_has(pid, conf) or _holds_files_under(pid, self.root) or _cmdline_has(pid, temps)
                    or any(_holds_files_under(pid, t) for t in self.ray_temp_dirs)):
                found.append(pid)
        return found

    def node_of(self, pid: int) -> str | None:
        """The node (n1, n2) a process of the bed runs on: ``SLURMD_NODENAME`` of its environment,
        else the node whose Ray folder it holds files in (a Ray process that set its title may show
        no environment); None when neither says."""
        name = _environ_value(pid, b"SLURMD_NODENAME")
        if name:
            return name
        for node, temp in zip(NODES, self.ray_temp_dirs):
            if _holds_files_under(pid, temp):
                return node
        return None

    def stop(self, timeout_s: float = 60.0) -> list[int]:
        """Cancel every job, stop the daemons (slurmd first, MariaDB last), kill what is left of the
        bed; return the PIDs that had to be killed after the daemons stopped."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.cancel_all(timeout_s / 2)
        order = [n for n in self.procs if n.startswith("slurmd-")] + ["slurmctld", "slurmdbd", "mariadbd", "munged"]
        for name in order:
            if name in self.procs:
                _terminate(self.procs[name], timeout_s / 4)
        killed = self.leftovers()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for folder in self.ray_temp_dirs:  # Ray's logs of the jobs (each job's own log stays in its job folder)
            shutil.rmtree(folder, ignore_errors=True)
        return killed

    def jobs(self) -> list[str]:
        """Ids of the jobs pending, running or completing ([] also when slurmctld does not answer)."""
        out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env())
        return out.stdout.split() if out.returncode == 0 else []

    def cancel_all(self, timeout_s: float = 60.0) -> None:
        """scancel every job and wait up to ``timeout_s`` until the queue is empty."""
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env(), capture_output=True)
        deadline = time.monotonic() + timeout_s
        while self.jobs() and time.monotonic() < deadline:
            time.sleep(1)

    def __enter__(self) -> SlurmBed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(p: subprocess.Popen, timeout_s: float) -> None:
    if p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in f.read().split(b"\0")
    except OSError:
        return False


def _environ_value(pid: int, key: bytes) -> str | None:
    """The value of ``key`` in the process's environment as /proc shows it (None: not there)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    prefix = key + b"="
    return next((e[len(prefix):].decode(errors="replace") for e in entries if e.startswith(prefix)), None)


def _descends_from(pid: int, ancestors: set[int]) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        if pid in ancestors:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: the parent's PID
        except (OSError, ValueError, IndexError):
            return False
        seen += 1
    return False


def _cmdline_has(pid: int, parts: list[bytes]) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return any(p in cmdline for p in parts)


def _holds_files_under(pid: int, root: Path) -> bool:
    prefix = str(root) + os.sep
    try:
        links = [f"/proc/{pid}/cwd"] + [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    for link in links:
        try:
            if os.readlink(link).startswith(prefix):
                return True
        except OSError:
            continue
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/hacrl-slurm", help="folder for config, state, logs (default %(default)s)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("slurm_testbed: run as root (the daemons run as root with SlurmUser=root)", file=sys.stderr)
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # for sigwait below
    bed = SlurmBed(args.dir)
    try:
        bed.start()
    except BedError as err:
        print(f"slurm_testbed: {err}", file=sys.stderr)
        return 1
    print(f"two nodes idle: {bed.node_states()}\n  export SLURM_CONF={bed.conf}\n  sinfo -N; "
          f"hacrl launch --executor slurm --account {ACCOUNT} --partition {PARTITION} --nodes 2 "
          "--container-image none --packager none --job-dir /tmp/hacrl-jobs --preset cpu_demo train.steps=3\n"
          "Ctrl-C stops every daemon.", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        killed = bed.stop()
        print(f"stopped{f'; killed leftover processes {killed}' if killed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
