"""A Ray cluster inside one Slurm job, then the hacrl command on its head node.

``srun`` runs :func:`ray_cluster_script` once per node (the executor asks for one task per node).
Node 0 starts the Ray head, waits until every node has joined, runs the command with
``RAY_ADDRESS`` pointing at the head (so :class:`~hacrl_megatron.agents.ray_agent.RayAgent`
places each agent's ranks anywhere in the job), stops Ray and exits with the command's status.
The other nodes join, then poll the head and exit 0 once it is gone: Slurm's ``--wait`` and
``--kill-on-bad-exit`` then see exactly the head's result, so a failed training run fails the job.

This mirrors NeMo-Run's Ray-on-Slurm templates (``SlurmRay`` launcher, ``ray.sub.j2``) but needs no
particular container layout and propagates the exit status (NeMo-Run's ``slurm_ray.sh.j2`` does
not). Helpers run as ``python -m hacrl_megatron.launch.slurm_ray ip|wait``.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import sys
import time

from hacrl_megatron.agents.ray_placement import require_ray

_SCRIPT = r"""# hacrl: one Ray node per Slurm task; node 0 is the head and runs the command (slurm_ray.py)
set -uo pipefail
PY=__PYTHON__
RAY=("$PY" -m ray.scripts.scripts)
PORT=__PORT__
TIMEOUT=__TIMEOUT__
NNODES="${SLURM_NNODES:-1}"
NODEID="${SLURM_NODEID:-0}"
# $HACRL_RAY_START_ARGS: extra per-node `ray start` flags from the environment (word-split on purpose)
# shellcheck disable=SC2206
RAY_ARGS=(--disable-usage-stats __RAY_ARGS__ ${HACRL_RAY_START_ARGS:-})
# Multi-GPU training defaults (override any of them with the job's --env): Megatron's TP/SP
# communication overlap needs one CUDA work queue per device so kernels run in issue order
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"  # a hung collective fails the job
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"  # InfiniBand retry timeout (4.096 us * 2^22 ~ 17 s)
__PLACEMENT__# Ray >= 2.5x token authentication: on by default here; every node and the driver must hold the same
# token: $RAY_AUTH_TOKEN (pass it with the job's env) or ~/.ray/auth_token on a shared home.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
RAY_PID=""
# Only this script's own Ray node is stopped (SIGTERM to its `ray start --block`); `ray stop` would
# kill every Ray process of the user on the node, other jobs' included.
stop_ray() { if [ -n "$RAY_PID" ]; then kill -TERM "$RAY_PID" 2>/dev/null; wait "$RAY_PID" 2>/dev/null; fi; }
head_up() { (exec 3<>"/dev/tcp/$HEAD_IP/$PORT") 2>/dev/null; }
if [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
  HEAD_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
else
  HEAD_HOST=$(hostname)
fi
if [ "$NODEID" = "0" ]; then
  HEAD_IP="${HACRL_RAY_HEAD_IP:-$("$PY" -m hacrl_megatron.launch.slurm_ray ip)}" || exit 1
  export RAY_ADDRESS="$HEAD_IP:$PORT"
  if [ "$RAY_AUTH_MODE" = "token" ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
    "${RAY[@]}" get-auth-token --generate >/dev/null || exit 1  # before the port opens: workers wait for it
  fi
  echo "[hacrl] starting the Ray head at $RAY_ADDRESS for $NNODES node(s)"
  "${RAY[@]}" start --head --block --node-ip-address="$HEAD_IP" --port="$PORT" --include-dashboard=false \
      "${RAY_ARGS[@]}" __HEAD_ARGS__&
  RAY_PID=$!
  trap 'stop_ray; exit 143' TERM
  if ! "$PY" -m hacrl_megatron.launch.slurm_ray wait --address "$RAY_ADDRESS" --nodes "$NNODES" --timeout "$TIMEOUT"; then
    stop_ray; exit 1
  fi
  __COMMAND__
  rc=$?
  echo "[hacrl] command exited with status $rc; stopping Ray"
  stop_ray
  exit $rc
else
  HEAD_IP="${HACRL_RAY_HEAD_IP:-$(getent hosts "$HEAD_HOST" | awk '{print $1; exit}')}"
  HEAD_IP="${HEAD_IP:-$HEAD_HOST}"
  export RAY_ADDRESS="$HEAD_IP:$PORT"
  deadline=$((SECONDS + TIMEOUT))
  until head_up; do
    if [ "$SECONDS" -ge "$deadline" ]; then echo "[hacrl] no Ray head at $RAY_ADDRESS after ${TIMEOUT}s" >&2; exit 1; fi
    sleep 2
  done
  "${RAY[@]}" start --block --address="$RAY_ADDRESS" "${RAY_ARGS[@]}" &
  RAY_PID=$!
  trap 'stop_ray; exit 0' TERM
  # leave as soon as the head is gone (before srun --wait=60 would kill this task)
  while kill -0 "$RAY_PID" 2>/dev/null && head_up; do sleep 5; done
  if head_up; then echo "[hacrl] Ray on $(hostname) exited while the head is up" >&2; wait "$RAY_PID"; exit 1; fi
  stop_ray
  exit 0
fi
"""


def ray_cluster_script(command: list[str], *, python: str = "python", port: int = 6379, wait_timeout_s: int = 600,
                       ray_start_args: list[str] | None = None, head_gpus: int | None = None,
                       placement: list[str] | None = None) -> str:
    """The bash script every node of the job runs (see module docstring).

    ``command`` runs on the head node once all ``$SLURM_NNODES`` nodes have joined;
    ``ray_start_args`` go to every ``ray start`` (e.g. ``--num-cpus=64``, ``--temp-dir=...``);
    ``head_gpus``: GPUs the head node offers Ray (0 when its GPUs run the controller's SGLang
    engines, :mod:`hacrl_megatron.launch.placement`); ``placement``: lines for the header.
    """
    if not command:
        raise ValueError("command must not be empty")
    if not 1 <= port <= 65535:
        raise ValueError(f"port={port}: must be a TCP port (1-65535)")
    if wait_timeout_s <= 0:
        raise ValueError(f"wait_timeout_s={wait_timeout_s}: must be > 0")
    if head_gpus is not None and head_gpus < 0:
        raise ValueError(f"head_gpus={head_gpus}: must be >= 0")
    lines = "".join(f"# placement: {line}\n" for line in placement or [])
    fill = {
        "__PLACEMENT__": lines,
        "__HEAD_ARGS__": "" if head_gpus is None else f"--num-gpus={int(head_gpus)} ",
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


def node_ip() -> str:
    """This node's address as other nodes reach it: the source address of the default route,
    else the host name's address when that is not loopback (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    ip = socket.gethostbyname(socket.gethostname())
    if ip.startswith("127."):
        raise RuntimeError(f"cannot find a non-loopback address of {socket.gethostname()} (got {ip}); "
                           "set HACRL_RAY_HEAD_IP")
    return ip


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def wait_for_nodes(address: str, nodes: int, timeout_s: float, poll_s: float = 5.0) -> int:
    """Block until ``nodes`` Ray nodes are alive in the cluster at ``address``; return how many are.

    Raises TimeoutError naming how many joined (look at the missing nodes' Slurm logs).
    """
    ray = require_ray()
    deadline = time.monotonic() + timeout_s
    host, _, port = address.rpartition(":")
    # ray.init blocks for minutes on a port nobody listens on yet: wait for the head's GCS port first
    while not _port_open(host, int(port)):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no Ray head listening at {address} within {timeout_s:g} s")
        time.sleep(min(poll_s, 1.0))
    ray.init(address=address, log_to_driver=False)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hacrl_megatron.launch.slurm_ray")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ip", help="print this node's address for the Ray head")
    w = sub.add_parser("wait", help="wait until N Ray nodes are alive")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.cmd == "ip":
        print(node_ip())
        return 0
    try:
        alive = wait_for_nodes(args.address, args.nodes, args.timeout)
    except TimeoutError as err:
        print(f"[hacrl] {err}", file=sys.stderr)
        return 1
    print(f"[hacrl] {alive} Ray node(s) ready at {args.address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
