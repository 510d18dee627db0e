"""A Ray cluster inside one Slurm job, then the hacrl command on its head node.

``srun`` runs :func:`ray_cluster_script` once per node (the executor asks for one task per node).
Node 0 starts the Ray head, waits until every node has joined, runs the command with
``RAY_ADDRESS`` pointing at the head (so :class:`~hacrl_megatron.agents.ray_agent.RayAgent`
places each agent's ranks anywhere in the job), stops Ray and exits with the command's status.
The other nodes join, then poll the head and exit 0 once it is done: Slurm's ``--wait`` and
``--kill-on-bad-exit`` then see exactly the head's result, so a failed training run fails the job.
When the command ends the head removes its address file (below) and waits up to a minute until the
other nodes have left Ray; each of them stops its Ray node on seeing the file gone, while the head's
GCS still answers, and only then does the head stop its own. (A Ray node that outlives the GCS waits
out its timeouts: 30 s to drain, then a minute in each of its agents, which by then have left the
job step's process tree.) A node that misses the file leaves once the head's port closes.
Every node offers all of its GPUs to Ray (rollout engines are Ray actors like the trainers' ranks),
except that a one-node job can keep the GPUs its ``rollout_gpu_ids`` reserve out of Ray's hands.

Ray's token authentication: ``$RAY_AUTH_TOKEN`` from the job's environment when set; otherwise the
head generates a token before its port opens and writes it to ``ray_auth_token.<job id>.<restart
count>`` in the job's folder (NeMo-Run's job directory, on the shared filesystem every node mounts)
with mode 0600; each other node waits for the head's port, reads the file, and the head removes it
when the command ends.

Addresses come from Slurm, not from the host's interfaces: every node's Ray binds the address
:func:`~hacrl_megatron.launch.node_address.node_address` finds (``$HACRL_RAY_NODE_IP``, else the
``--socket-ifname`` interface's, else the ``NodeAddr`` of ``$SLURMD_NODENAME``); a node without one
stops the job with one line naming it. The head's address (``$HACRL_RAY_HEAD_IP`` when set) goes to
``ray_head.<job id>.<restart count>`` in the job's folder before its port opens, where the other
nodes read it; the head removes it at the end.

This mirrors NeMo-Run's Ray-on-Slurm templates (``SlurmRay`` launcher, ``ray.sub.j2``) but needs no
particular container layout and propagates the exit status (NeMo-Run's ``slurm_ray.sh.j2`` does
not). Helpers run as ``python -m hacrl_megatron.launch.slurm_ray ip|wait|leave``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import sys
import time
from pathlib import Path

from hacrl_megatron.launch.node_address import NodeAddressError, node_address

_SCRIPT = r"""# hacrl: one Ray node per Slurm task; node 0 is the head and runs the command (slurm_ray.py)
set -uo pipefail
PY=__PYTHON__
# Ray starts some of its processes (ray_client_server, workers with a runtime_env) through `bash -c`
# with the interpreter's and its own library's paths unquoted: under a folder with a space they never
# start and `ray start --block` stops the node. Such an interpreter is run through a private,
# space-free link to its prefix folder (the venv or conda env: it finds its libraries from there).
PY_LINK_DIR=""
case "$PY" in
  *[[:space:]]*)
    PY_LINK_DIR=$(mktemp -d /tmp/hacrl-py.XXXXXXXX) || { echo "[hacrl] cannot make a folder in /tmp for $PY" >&2; exit 1; }
    trap 'rm -rf "$PY_LINK_DIR"' EXIT  # the link only: rm does not follow it
    ln -s "$(dirname "$(dirname "$PY")")" "$PY_LINK_DIR/prefix" || exit 1
    PY="$PY_LINK_DIR/prefix/bin/$(basename "$PY")"
    ;;
esac
RAY=("$PY" -m ray.scripts.scripts)
PORT=__PORT__
TIMEOUT=__TIMEOUT__
NNODES="${SLURM_NNODES:-1}"
NODEID="${SLURM_NODEID:-0}"
# the job's folder (this script is its scripts/<name>.sh): on the shared filesystem, seen by every node
JOB_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# $HACRL_RAY_START_ARGS: extra per-node `ray start` flags from the environment (word-split on purpose)
# shellcheck disable=SC2206
# every node carries a resource named after its Slurm node index, so engines the planner put on node k
# are placed there (rollout/engine_actor.py: node_resource)
RAY_ARGS=(--disable-usage-stats "--resources={\"hacrl_node_$NODEID\": 1000}" __RAY_ARGS__ ${HACRL_RAY_START_ARGS:-})
# job-wide GPU indices (agents.N.rollout_gpu_ids) are node * HACRL_GPUS_PER_NODE + local id
export HACRL_GPUS_PER_NODE="${HACRL_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
# Multi-GPU training defaults (override any of them with the job's --env): Megatron's TP/SP
# communication overlap needs one CUDA work queue per device so kernels run in issue order
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"  # a hung collective fails the job
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"  # InfiniBand retry timeout (4.096 us * 2^22 ~ 17 s)
__SOCKET__
__PLACEMENT__# Ray >= 2.5x token authentication: on by default here; every node and the driver hold the same
# token: $RAY_AUTH_TOKEN when the job's env sets it, else the head generates one and writes it,
# readable by this user only (mode 0600), to a file in the job's folder that every node reads.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
TOKEN_FILE="${HACRL_RAY_TOKEN_FILE:-$JOB_DIR/ray_auth_token.${SLURM_JOB_ID:-local}.${SLURM_RESTART_COUNT:-0}}"
WROTE_TOKEN=""
RAY_PID=""
# Only this script's own Ray node is stopped (SIGTERM to its `ray start --block`); `ray stop` would
# kill every Ray process of the user on the node, other jobs' included.
stop_ray() { if [ -n "$RAY_PID" ]; then kill -TERM "$RAY_PID" 2>/dev/null; wait "$RAY_PID" 2>/dev/null; fi; }
forget_token() { if [ -n "$WROTE_TOKEN" ]; then rm -f "$TOKEN_FILE"; fi; }
head_up() { (exec 3<>"/dev/tcp/$HEAD_IP/$PORT") 2>/dev/null; }
# the head's address, for the other nodes: written by the head before its port opens, removed at the
# end, which tells the other nodes to leave
HEAD_FILE="$JOB_DIR/ray_head.${SLURM_JOB_ID:-local}.${SLURM_RESTART_COUNT:-0}"
WROTE_HEAD=""
SAW_HEAD=""
forget_head() { if [ -n "$WROTE_HEAD" ]; then rm -f "$HEAD_FILE"; fi; }
# the head's command is done: its address file was seen and is gone now
head_done() { if [ -e "$HEAD_FILE" ]; then SAW_HEAD=1; return 1; fi; [ -n "$SAW_HEAD" ]; }
# this node's address as Slurm knows it ($HACRL_RAY_NODE_IP, else __ADDRESS_SOURCE__);
# one line naming the node and exit 1 when there is none
node_ip() { "$PY" -m hacrl_megatron.launch.slurm_ray ip __IP_ARGS__; }
__HELPERS__if [ "$NODEID" = "0" ]; then
  # the files first: Slurm's KillWait may end this script while Ray drains (scancel, a time limit)
  trap 'forget_token; forget_head; stop_ray; exit 143' TERM
  HEAD_IP="${HACRL_RAY_HEAD_IP:-$(node_ip)}" || exit 1
  export RAY_ADDRESS="$HEAD_IP:$PORT"
  # a one-node job outside Slurm runs on 127.0.0.1, which Ray would turn into the machine's network
  # address unless its single-machine mode is on (agents/ray_placement.py does the same)
  if [ "$HEAD_IP" = "127.0.0.1" ]; then export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; fi
  if [ "$RAY_AUTH_MODE" = "token" ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
    # before the port opens: the workers wait for the head's port, then read the file
    RAY_AUTH_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(32))') || exit 1
    export RAY_AUTH_TOKEN
    if ! (umask 077 && printf '%s\n' "$RAY_AUTH_TOKEN" > "$TOKEN_FILE.tmp" && mv -f "$TOKEN_FILE.tmp" "$TOKEN_FILE"); then
      echo "[hacrl] cannot write the Ray auth token to $TOKEN_FILE" >&2; exit 1
    fi
    WROTE_TOKEN=1
  fi
  if ! (printf '%s\n' "$HEAD_IP" > "$HEAD_FILE.tmp" && mv -f "$HEAD_FILE.tmp" "$HEAD_FILE"); then
    echo "[hacrl] cannot write the Ray head's address to $HEAD_FILE" >&2; forget_token; exit 1
  fi
  WROTE_HEAD=1
  echo "[hacrl] starting the Ray head at $RAY_ADDRESS for $NNODES node(s)"
  __HEAD_GPUS__"${RAY[@]}" start --head --block --node-ip-address="$HEAD_IP" --port="$PORT" \
      --include-dashboard=false "${RAY_ARGS[@]}" __HEAD_ARGS__&
  RAY_PID=$!
  # --head-pid: a head that dies while starting (a taken port, a bad flag) fails the job now, not after $TIMEOUT
  if ! "$PY" -m hacrl_megatron.launch.slurm_ray wait --address "$RAY_ADDRESS" --nodes "$NNODES" --timeout "$TIMEOUT" \
      --head-pid "$RAY_PID"; then
    forget_token; forget_head; stop_ray; exit 1
  fi
  __COMMAND__
  rc=$?
  echo "[hacrl] command exited with status $rc; stopping Ray"
  forget_token
  forget_head  # the other nodes leave now, while this node's GCS still answers their drain
  if [ "$NNODES" -gt 1 ]; then "$PY" -m hacrl_megatron.launch.slurm_ray leave --address "$RAY_ADDRESS" --timeout 60; fi
  stop_ray
  exit $rc
else
  NODE_IP=$(node_ip) || exit 1
  deadline=$((SECONDS + TIMEOUT))
  if [ -n "${HACRL_RAY_HEAD_IP:-}" ]; then
    HEAD_IP="$HACRL_RAY_HEAD_IP"
  else
    until [ -s "$HEAD_FILE" ]; do  # a shared filesystem may lag
      if [ "$SECONDS" -ge "$deadline" ]; then echo "[hacrl] no Ray head address in $HEAD_FILE after ${TIMEOUT}s" >&2; exit 1; fi
      sleep 2
    done
    HEAD_IP=$(cat "$HEAD_FILE") || exit 1
    SAW_HEAD=1
  fi
  export RAY_ADDRESS="$HEAD_IP:$PORT"
  until head_up; do
    if [ "$SECONDS" -ge "$deadline" ]; then echo "[hacrl] no Ray head at $RAY_ADDRESS after ${TIMEOUT}s" >&2; exit 1; fi
    sleep 2
  done
  if [ "$RAY_AUTH_MODE" = "token" ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
    until [ -s "$TOKEN_FILE" ]; do  # written before the head's port opened; a shared filesystem may lag
      if [ "$SECONDS" -ge "$deadline" ]; then echo "[hacrl] no Ray auth token in $TOKEN_FILE after ${TIMEOUT}s" >&2; exit 1; fi
      sleep 2
    done
    RAY_AUTH_TOKEN=$(cat "$TOKEN_FILE") || exit 1
    export RAY_AUTH_TOKEN
  fi
  trap 'stop_ray; exit 0' TERM
  # Ray's startup has fixed limits (its raylet waits 15 s for the dashboard agent, `ray start` 30 s for
  # the raylet to register) that a busy node can miss: a Ray that ends while the head is up is started
  # again, three starts in all. Leave as soon as the head is done: its address file gone (the head waits
  # for this node to leave Ray) or its port closed (before srun --wait=60 kills this task).
  for attempt in 1 2 3; do
    "${RAY[@]}" start --block --address="$RAY_ADDRESS" --node-ip-address="$NODE_IP" "${RAY_ARGS[@]}" &
    RAY_PID=$!
    while kill -0 "$RAY_PID" 2>/dev/null && head_up && ! head_done; do sleep 2; done
    if head_done || ! head_up; then break; fi
    wait "$RAY_PID"
    RAY_PID=""
    echo "[hacrl] Ray on ${SLURMD_NODENAME:-$(hostname)} exited while the head is up (start $attempt of 3)" >&2
  done
  if head_up && ! head_done; then exit 1; fi
  stop_ray
  exit 0
fi
"""
_VISIBLE_IDS = r"""# local GPU indices -> the ids of this task's CUDA_VISIBLE_DEVICES (Slurm may number them otherwise)
visible_ids() {
  local ids=() visible=() i
  IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
  for i in "$@"; do ids+=("${visible[$i]:-$i}"); done
  (IFS=,; echo "${ids[*]}")
}
"""
# NCCL_SOCKET_IFNAME's syntax: interface names or prefixes, comma-separated, ^ to exclude, = for exact
_IFNAME = re.compile(r"^[\^=]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$")


def ray_cluster_script(command: list[str], *, python: str = "python", port: int = 6379, wait_timeout_s: int = 600,
                       ray_start_args: list[str] | None = None, head_gpu_ids: list[int] | None = None,
                       socket_ifname: str | None = None, placement: list[str] | None = None) -> str:
    """The bash script every node of the job runs (see module docstring).

    ``command`` runs on the head node once all ``$SLURM_NNODES`` nodes have joined;
    ``ray_start_args`` go to every ``ray start`` (e.g. ``--num-cpus=64``, ``--temp-dir=...``);
    ``head_gpu_ids``: the head node's local GPUs offered to Ray (None: all, as on every other
    node; a one-node job lists the GPUs its ``rollout_gpu_ids`` leave to the trainers,
    :mod:`hacrl_megatron.launch.placement`); ``socket_ifname``: exported as ``NCCL_SOCKET_IFNAME``
    and ``GLOO_SOCKET_IFNAME`` on every node (None: NCCL's and gloo's own choice);
    ``placement``: lines for the header.
    """
    if not command:
        raise ValueError("command must not be empty")
    if not 1 <= port <= 65535:
        raise ValueError(f"port={port}: must be a TCP port (1-65535)")
    if wait_timeout_s <= 0:
        raise ValueError(f"wait_timeout_s={wait_timeout_s}: must be > 0")
    if head_gpu_ids is not None and (any(g < 0 for g in head_gpu_ids) or len(set(head_gpu_ids)) != len(head_gpu_ids)):
        raise ValueError(f"head_gpu_ids={head_gpu_ids}: must be distinct local GPU indices >= 0")
    if socket_ifname is not None and not _IFNAME.match(socket_ifname):
        raise ValueError(f"socket_ifname={socket_ifname!r}: not a network interface list (e.g. ib0, eth, ^docker,lo)")
    lines = "".join(f"# placement: {line}\n" for line in placement or [])
    socket = ("# the network interface of NCCL's and gloo's bootstrap and data sockets (--socket-ifname)\n"
              f"export NCCL_SOCKET_IFNAME={shlex.quote(socket_ifname)}\n"
              f"export GLOO_SOCKET_IFNAME={shlex.quote(socket_ifname)}" if socket_ifname else
              "# NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: unset (NCCL's and gloo's own choice; --socket-ifname)")
    head_gpus = ""
    head_args = ""
    if head_gpu_ids is not None:
        ids = " ".join(str(int(g)) for g in head_gpu_ids)
        head_gpus = f'CUDA_VISIBLE_DEVICES="$(visible_ids {ids})" ' if head_gpu_ids else ""
        head_args = f"--num-gpus={len(head_gpu_ids)} "
    fill = {
        "__HELPERS__": _VISIBLE_IDS if head_gpus else "",
        "__SOCKET__": socket,
        "__IP_ARGS__": f"--ifname {shlex.quote(socket_ifname)}" if socket_ifname else "",
        "__ADDRESS_SOURCE__": (f"the address of interface {socket_ifname}" if socket_ifname else
                               "the NodeAddr of $SLURMD_NODENAME"),
        "__PLACEMENT__": lines,
        "__HEAD_GPUS__": head_gpus,
        "__HEAD_ARGS__": head_args,
        "__PYTHON__": shlex.quote(python),
        "__PORT__": str(int(port)),
        "__TIMEOUT__": str(int(wait_timeout_s)),
        "__RAY_ARGS__": " ".join(shlex.quote(a) for a in ray_start_args or []),
        "__COMMAND__": shlex.join(command),
    }
    script = _SCRIPT
    for key, value in fill.items():
        script = script.replace(key, value)
    return script


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (an exited child its parent has not reaped yet, a
    zombie, counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # without procfs os.kill's answer stands; with it, the process exited just now
        return not Path("/proc/self").exists()
    return stat[stat.rindex(")") + 2] not in "ZX"  # the state field follows the parenthesised command name


def wait_for_nodes(address: str, nodes: int, timeout_s: float, poll_s: float = 5.0,
                   head_pid: int | None = None) -> int:
    """Block until ``nodes`` Ray nodes are alive in the cluster at ``address``; return how many are.

    ``head_pid``: the head's ``ray start --head --block`` process; when it exits before its port opens (its
    GCS could not bind the port, a bad flag) this fails at once with RuntimeError instead of waiting out
    ``timeout_s``. Raises TimeoutError naming how many joined (look at the missing nodes' Slurm logs).
    """
    from hacrl_megatron.agents.ray_placement import require_ray  # imports torch: not for the `ip` helper

    ray = require_ray()
    deadline = time.monotonic() + timeout_s
    host, _, port = address.rpartition(":")

    def fail_if_the_head_exited(when: str) -> None:
        if head_pid is not None and not process_running(head_pid):
            raise RuntimeError(f"the Ray head (`ray start --head`, pid {head_pid}) exited {when}; "
                               "its error is above in this job's output")

    # ray.init blocks for minutes on a port nobody listens on yet: wait for the head's GCS port first
    while not _port_open(host, int(port)):
        fail_if_the_head_exited(f"before {address} opened")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no Ray head listening at {address} within {timeout_s:g} s")
        time.sleep(min(poll_s, 1.0))
    # the GCS port opens before the head's own node has registered, and ray.init fails until it has
    # ("No node info found"): try again while the head runs
    while True:
        try:
            ray.init(address=address, log_to_driver=False)
            break
        except ConnectionError as err:
            ray.shutdown()
            fail_if_the_head_exited("while starting")  # raised while handling err: err stays its context
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not connect to the Ray head at {address} within {timeout_s:g} s: "
                                   f"{err}") from err
            time.sleep(1.0)
    try:
        while True:
            alive = sum(1 for n in ray.nodes() if n.get("Alive", False))
            if alive >= nodes:
                return alive
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Ray cluster at {address}: {alive} of {nodes} nodes joined within {timeout_s:g} s; "
                                   "see the other nodes' logs in the Slurm job output")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def wait_for_others_to_leave(address: str, timeout_s: float, poll_s: float = 1.0) -> int:
    """Block until the calling head's node is the only Ray node alive at ``address``, at most
    ``timeout_s`` seconds; return how many other nodes are still alive then (0: all left).
    Raises ConnectionError when nothing listens at ``address`` (the head's Ray is gone)."""
    host, _, port = address.rpartition(":")
    if not _port_open(host, int(port)):  # ray.init would wait out its own timeouts
        raise ConnectionError(f"no Ray head listening at {address}")
    import ray  # not require_ray: no torch import while the job winds down

    ray.init(address=address, log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            others = sum(1 for n in ray.nodes() if n.get("Alive", False)) - 1
            if others <= 0 or time.monotonic() >= deadline:
                return max(others, 0)
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hacrl_megatron.launch.slurm_ray")
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ip", help="print this node's address (node_address.py: $HACRL_RAY_NODE_IP, the "
                                  "--ifname interface, else Slurm's NodeAddr of $SLURMD_NODENAME)")
    a.add_argument("--ifname", help="NCCL-style interface list (--socket-ifname)")
    a.add_argument("--node", help="Slurm node name (default $SLURMD_NODENAME)")
    w = sub.add_parser("wait", help="wait until N Ray nodes are alive")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    w.add_argument("--head-pid", type=int, help="the head's `ray start --head` process: fail at once if it exits "
                                                  "before the port opens")
    lv = sub.add_parser("leave", help="on the head: wait until the other Ray nodes have left (never fails)")
    lv.add_argument("--address", required=True)
    lv.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.cmd == "ip":
        try:
            print(node_address(ifname=args.ifname, node=args.node))
        except NodeAddressError as err:
            print(f"[hacrl] {err}", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "leave":  # best effort: the job's status is the command's, whatever happens here
        try:
            left = wait_for_others_to_leave(args.address, args.timeout)
        except Exception as err:  # noqa: BLE001 - any failure: the head stops its Ray anyway
            print(f"[hacrl] could not wait for the other Ray nodes to leave ({type(err).__name__}: {err})",
                  file=sys.stderr)
            return 0
        if left:
            print(f"[hacrl] {left} other Ray node(s) still up after {args.timeout:g} s; stopping the head anyway",
                  file=sys.stderr)
        return 0
    try:
        alive = wait_for_nodes(args.address, args.nodes, args.timeout, head_pid=args.head_pid)
    except (TimeoutError, RuntimeError) as err:
        print(f"[hacrl] {err}", file=sys.stderr)
        return 1
    print(f"[hacrl] {alive} Ray node(s) ready at {args.address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
