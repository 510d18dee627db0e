"""What does one step's exchange cost on each backend? (docs/exchange.md)

Two agents of one run exchange per-(step, agent) records through each store: per step, agent1
publishes its record and waits for agent2's (already there: this times the exchange itself, not a
late peer), then prunes its records beyond ``--keep-steps``. Times are the median over ``--steps``
steps of publish + wait_for + prune, unsigned and signed (HMAC-SHA256), for a small record (the
CPU demo's size) and a large one (64 prompts × 8 responses × 4,000 characters ≈ 2 MB). The redis
backend runs on a temporary password-protected redis-server on 127.0.0.1 (Debian's package) when
one is installed; ``shared_dir`` writes under ``--dir`` (default: a temp folder on this machine's
disk — a cluster filesystem is slower, measure there with ``--dir``).

    python benchmarks/bench_exchange.py --out benchmarks/EXCHANGE_overhead.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hacrl_megatron.exchange.remote import LocalStore, PeerRecord, load_key, open_store  # noqa: E402

SIZES = {"small": (8, 4, 200), "large": (64, 8, 4000)}  # prompts, responses per prompt, characters each


def record(run_id: str, step: int, agent: str, prompts: int, group: int, chars: int) -> PeerRecord:
    text = ("The sum is 12 + 30 = 42, so the answer is \\boxed{42}. " * (chars // 50 + 1))[:chars]
    return PeerRecord(run_id=run_id, step=step, agent=agent, weights_version=step,
                      prompt_ids=[f"addition-train-{i}" for i in range(prompts)],
                      responses=[[text] * group for _ in range(prompts)],
                      finish_reasons=[["eos"] * group for _ in range(prompts)],
                      rewards=[[float(j % 2) for j in range(group)] for _ in range(prompts)],
                      logp_sums=[[-123.456789 - j for j in range(group)] for _ in range(prompts)],
                      lengths=[[chars // 4] * group for _ in range(prompts)],
                      response_tokens=[[chars // 4 - 1] * group for _ in range(prompts)], positive_rate=0.5,
                      config_digest="sha256:" + "0" * 64)


def time_backend(make, size: str, steps: int, keep_steps: int) -> dict[str, float]:
    """Median ms per step of agent1's publish + wait_for(agent2) + prune, and the record's bytes."""
    mine, peer = make(), make()
    p, g, c = SIZES[size]
    times = []
    for step in range(steps):
        peer.publish(record(mine.run_id, step, "agent2", p, g, c))
        own = record(mine.run_id, step, "agent1", p, g, c)
        t0 = time.perf_counter()
        mine.publish(own)
        result = mine.wait_for(step, ["agent2"], wait_s=10)
        mine.prune("agent1", step, keep_steps)
        times.append(time.perf_counter() - t0)
        assert result.complete, result
    for store in {id(mine): mine, id(peer): peer}.values():
        store.close()
    return {"ms_per_step": 1000 * statistics.median(times), "record_bytes": len(own.to_json())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--keep-steps", type=int, default=4)
    ap.add_argument("--dir", default=None, help="shared_dir folder (default: a temp folder)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_exchange_"))
    key_file = tmp / "key"
    key_file.write_text("k" * 64)
    key_file.chmod(0o600)
    options = {"local": {}, "shared_dir": {"dir": args.dir or tmp / "exchange"}}
    proc = None
    try:
        from tests.fixtures.redis_server import start_redis

        proc, server = start_redis(tmp)
        options["redis"] = {"redis_url": server.url, "redis_password_file": server.password_file}
    except BaseException as err:  # pytest's skip is a BaseException; anything else: report and go on
        print(f"redis: not measured ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
    results = []
    try:
        for backend, opts in options.items():
            shared_local = {}
            for signed in (False, True):
                for size in SIZES:
                    run_id = f"bench-{backend}-{size}-{int(signed)}"

                    def make(backend=backend, opts=opts, run_id=run_id, signed=signed, shared_local=shared_local):
                        key = key_file if signed else None
                        if backend == "local":  # two "jobs" in one process share one memory
                            store = LocalStore(run_id, key=load_key(key) if key else None,
                                               share_with=shared_local.get(run_id))
                            shared_local.setdefault(run_id, store)
                            return store
                        return open_store(backend, run_id, key_file=key, **opts)

                    row = {"backend": backend, "signed": signed, "size": size,
                           **time_backend(make, size, args.steps, args.keep_steps)}
                    results.append(row)
                    print(f"{backend:10s} {'signed' if signed else 'unsigned':8s} {size:5s} "
                          f"{row['record_bytes'] / 1e6:7.3f} MB  {row['ms_per_step']:8.2f} ms/step")
    finally:
        if proc is not None:
            from tests.fixtures.redis_server import stop_redis

            stop_redis(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "sizes": SIZES, "results": results}, indent=1))


if __name__ == "__main__":
    main()
