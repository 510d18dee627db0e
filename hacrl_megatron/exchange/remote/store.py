"""The exchange store interface every backend implements, its wait result, and the in-process backend.

Per step each agent's job publishes its :class:`~.record.PeerRecord` and waits for its peers'
records of the same step. :class:`ExchangeStore` is that contract: ``publish`` / ``read`` /
``wait_for`` / ``prune``; the backends differ only in where the bytes live (``local``: this
process's memory; ``shared_dir``: one JSON file per (step, agent) in a folder every job can reach;
``redis``: one key per (step, agent) on a Redis server).

A bad record (damaged, forged, of another run or step) never stops a wait: it is refused with its
one-line reason, logged, and its author stays missing unless a valid record replaces it before the
wait ends (a peer's later atomic write does); :class:`WaitResult` reports both.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from hacrl_megatron.errors import InputError
from hacrl_megatron.exchange.remote.record import (
    DEFAULT_LIMITS,
    ExchangeRecordError,
    Limits,
    PeerRecord,
    parse_record,
)
from hacrl_megatron.exchange.remote.signing import SIGNATURE_FIELD, sign, verify

log = logging.getLogger(__name__)

# run ids and agent names become file names and Redis keys: a closed, path-safe alphabet
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
AGENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")  # the config's identifier rule, ASCII only
POLL_FIRST_S, POLL_MAX_S = 0.01, 0.25  # poll back-off: quick when peers are close, cheap when they are far
MAX_HOLDER_CHARS = 256  # a job's id in a claim (host, pid, random part)
MAX_RUN_DOC_BYTES = 64 << 10  # the run document: a nonce and the agents that joined it
NONCE_RE = re.compile(r"[0-9a-f]{32}")
MAX_JOIN_TRIES = 64  # create-only races lost in a row before joining gives up (each loss means another job won)


class RunJoinError(InputError):
    """This job cannot join the exchange's current run (a resumed job whose peers started a fresh run, or a
    damaged or forged run document); the message names the run id and what to do."""


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
        raise InputError(f"exchange run id {run_id!r}: must match {RUN_ID_RE.pattern} (it names folders and keys)")
    return run_id


def check_agent(agent: str) -> str:
    if not isinstance(agent, str) or not AGENT_RE.fullmatch(agent):
        raise InputError(f"exchange agent name {agent!r}: must match {AGENT_RE.pattern}")
    return agent


class ExchangeBackendError(RuntimeError):
    """The exchange cannot be reached or refused an operation (a server down, a folder gone or unwritable);
    the message names the server or folder. A training job stops with exit 1 and resumes from its checkpoint."""


@dataclass(frozen=True)
class WaitResult:
    """What :meth:`ExchangeStore.wait_for` found for one step.

    Fields:
        records: peer name → its valid record, for the peers whose record arrived in time.
        missing: the peers without a valid record when the wait ended (in the order asked).
        refused: peer name → the one-line reason its latest record was refused (a subset of missing).
        waited_s: seconds spent waiting.
    """

    records: dict[str, PeerRecord]
    missing: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)
    waited_s: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.missing


class ExchangeStore(ABC):
    """Records of one run, keyed by (step, agent). Subclasses store bytes (``_put``/``_get``/``_steps``/
    ``_delete``); checking, signing and waiting live here so every backend refuses the same records."""

    backend = ""

    def __init__(self, run_id: str, *, key: bytes | None = None, limits: Limits = DEFAULT_LIMITS) -> None:
        self.run_id = check_run_id(run_id)
        self.key = key
        self.limits = limits
        self.run_nonce = ""  # set by join_run: records of another nonce are refused from then on
        self._refusals_logged: set[tuple[int, str, str]] = set()
        self._run_generation = 0  # the newest run document seen (documents are numbered from 1)

    def publish(self, record: PeerRecord) -> None:
        """Store ``record`` (signed when the store has a key), replacing any earlier one of its (step, agent)."""
        if record.run_id != self.run_id:
            raise ValueError(f"exchange: record of run {record.run_id!r} published to run {self.run_id!r}")
        data = record.to_json(self.key)
        if len(data) > self.limits.max_bytes:
            raise ValueError(f"exchange: agent {record.agent!r}'s record of step {record.step} is {len(data)} bytes, "
                             f"more than the limit of {self.limits.max_bytes}")
        self._put(record.step, check_agent(record.agent), data)

    def read(self, step: int, agent: str) -> PeerRecord | None:
        """``agent``'s record of ``step``; None when there is none yet. Raises :class:`ExchangeRecordError`
        (one line naming ``agent`` and the field) for a record that fails a check."""
        found = self._get(step, check_agent(agent))
        if found is None:
            return None
        data, origin = found
        return parse_record(data, run_id=self.run_id, step=step, agent=agent, origin=origin, key=self.key,
                            limits=self.limits, run_nonce=self.run_nonce)

    def join_run(self, agent: str, fresh: bool) -> str:
        """Join this run id's current run and return its nonce (kept in :attr:`run_nonce`; every record
        published from then on carries it and every record read must).

        The store keeps numbered run documents ({nonce, agents that joined}), each written once (a
        create-only write: of two jobs racing for a number one wins, the other reads it and tries again).
        A fresh job (``fresh``) joins the newest run when ``agent`` is not in it yet (a peer started it),
        and starts a new run with a new nonce when it is (that run is an earlier one of this agent): so
        the records of an earlier run, replayed or left over, never pass as this run's. A resumed job
        continues the newest run, which must list ``agent``; else :class:`RunJoinError`."""
        check_agent(agent)
        for _ in range(MAX_JOIN_TRIES):
            generation, doc = self._newest_run_doc()
            if doc is not None and agent in doc["agents"] and not fresh:
                self.run_nonce = doc["nonce"]
                return self.run_nonce
            if doc is not None and not fresh:
                raise RunJoinError(f"exchange run {self.run_id!r}: this job resumes agent {agent!r}, but the run's "
                                   f"jobs since started a fresh run without it (agents {doc['agents']}): resume "
                                   "every job of the run, or start them all fresh")
            if doc is not None and agent not in doc["agents"]:
                new = {"nonce": doc["nonce"], "agents": [*doc["agents"], agent]}
            else:  # no run yet, or this agent's earlier run: a new one
                new = {"nonce": secrets.token_hex(16), "agents": [agent]}
            body = dict(new)
            if self.key is not None:
                body[SIGNATURE_FIELD] = sign(new, self.key)
            if self._create_run_doc(generation + 1, json.dumps(body, sort_keys=True).encode()):
                self._run_generation = generation + 1
                self.run_nonce = new["nonce"]
                return self.run_nonce
        raise ExchangeBackendError(f"exchange run {self.run_id!r}: lost {MAX_JOIN_TRIES} create-only races in a row "
                                   "for the run document (too many jobs starting at once)")

    def _newest_run_doc(self) -> tuple[int, dict | None]:
        """(number, checked content) of the newest run document; (0, None) when there is none."""
        generation, doc = self._run_generation, None
        if generation:
            doc = self._run_doc(generation)
        while True:
            data = self._get_run_doc(generation + 1)
            if data is None:
                self._run_generation = generation
                return generation, doc
            generation, doc = generation + 1, self._parse_run_doc(generation + 1, data)

    def _run_doc(self, generation: int) -> dict:
        data = self._get_run_doc(generation)
        if data is None:
            raise RunJoinError(f"exchange run {self.run_id!r}: run document {generation} disappeared")
        return self._parse_run_doc(generation, data)

    def _parse_run_doc(self, generation: int, data: bytes) -> dict:
        where = f"exchange run {self.run_id!r}: run document {generation}"
        try:
            doc = json.loads(data[:MAX_RUN_DOC_BYTES].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise RunJoinError(f"{where}: not valid JSON (damaged; delete the run's exchange records to start "
                               "over)") from None
        if self.key is not None and isinstance(doc, dict):
            problem = verify(doc, self.key)
            if problem:
                raise RunJoinError(f"{where}: field {SIGNATURE_FIELD!r}: {problem}")
        if (not isinstance(doc, dict) or not isinstance(doc.get("nonce"), str) or not NONCE_RE.fullmatch(doc["nonce"])
                or not isinstance(doc.get("agents"), list)
                or not all(isinstance(a, str) and AGENT_RE.fullmatch(a) for a in doc["agents"])):
            raise RunJoinError(f"{where}: must be {{'nonce': 32 hex digits, 'agents': [names]}} (damaged or forged)")
        return {"nonce": doc["nonce"], "agents": list(doc["agents"])}

    def wait_for(self, step: int, peers: Sequence[str], wait_s: float) -> WaitResult:
        """Wait at most ``wait_s`` seconds (≥ 0; 0 looks once) for every peer's valid record of ``step``."""
        if not wait_s >= 0:
            raise ValueError(f"exchange.wait_s={wait_s!r}: must be >= 0")
        start = time.monotonic()
        deadline, pause = start + wait_s, POLL_FIRST_S
        records: dict[str, PeerRecord] = {}
        refused: dict[str, str] = {}
        while True:
            token = self._poll_token()
            for peer in peers:
                if peer in records:
                    continue
                try:
                    record = self.read(step, peer)
                except ExchangeRecordError as err:
                    refused[peer] = str(err)
                    self._log_refusal(step, peer, str(err))
                    continue
                if record is not None:
                    records[peer] = record
                    refused.pop(peer, None)
            left = deadline - time.monotonic()
            if len(records) == len(peers) or left <= 0:
                break
            self._sleep(token, min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)
        missing = tuple(p for p in peers if p not in records)
        return WaitResult(records, missing, {p: refused[p] for p in missing if p in refused},
                          time.monotonic() - start)

    def claim(self, agent: str, holder: str) -> None:
        """Record that the job ``holder`` (an id unique to one job) now trains ``agent`` in this run; a later
        claim replaces it (a restarted job takes its agent over)."""
        if not holder or len(holder) > MAX_HOLDER_CHARS:
            raise ValueError(f"exchange claim: holder {holder!r} must be 1 to {MAX_HOLDER_CHARS} characters")
        self._put_claim(check_agent(agent), holder.encode())

    def holder_of(self, agent: str) -> str | None:
        """The job that claimed ``agent`` last (:meth:`claim`), None when none did."""
        data = self._get_claim(check_agent(agent))
        return None if data is None else data[:MAX_HOLDER_CHARS].decode("utf-8", "replace")

    def steps(self, agent: str) -> list[int]:
        """The steps ``agent`` has records of here, ascending."""
        return sorted(self._steps(check_agent(agent)))

    def prune(self, agent: str, step: int, keep_steps: int) -> int:
        """Delete ``agent``'s records older than the last ``keep_steps`` steps up to ``step`` (steps
        ≤ step − keep_steps); returns how many. Each job prunes only its own records: a peer that
        resumes from an older checkpoint re-reads those it still needs."""
        if keep_steps < 1:
            raise ValueError(f"exchange.keep_steps={keep_steps!r}: must be >= 1")
        old = [s for s in self._steps(check_agent(agent)) if s <= step - keep_steps]
        for s in old:
            self._delete(s, agent)
        return len(old)

    def close(self) -> None:  # noqa: B027 - a hook: only backends with connections override it
        """Release connections; the records stay."""

    def __enter__(self) -> ExchangeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _poll_token(self) -> object:
        """Taken before each round of reads and handed to :meth:`_sleep` (a backend that can be woken
        uses it to see a publish that landed between the reads and the sleep)."""
        return None

    def _sleep(self, token: object, seconds: float) -> None:
        time.sleep(seconds)

    def _log_refusal(self, step: int, peer: str, message: str) -> None:
        if (step, peer, message) not in self._refusals_logged:  # once per distinct refusal, not once per poll
            self._refusals_logged.add((step, peer, message))
            log.warning("%s", message)

    @abstractmethod
    def _put(self, step: int, agent: str, data: bytes) -> None:
        """Store ``data`` as (step, agent)'s record, all or nothing."""

    @abstractmethod
    def _get(self, step: int, agent: str) -> tuple[bytes, str] | None:
        """(bytes, origin for messages) of (step, agent)'s record, at most ``limits.max_bytes + 1`` bytes; None if absent."""

    @abstractmethod
    def _steps(self, agent: str) -> list[int]:
        """The steps ``agent`` has records of."""

    @abstractmethod
    def _delete(self, step: int, agent: str) -> None:
        """Remove (step, agent)'s record if present."""

    @abstractmethod
    def _put_claim(self, agent: str, data: bytes) -> None:
        """Store ``agent``'s claim (the holder's id), replacing any."""

    @abstractmethod
    def _get_claim(self, agent: str) -> bytes | None:
        """``agent``'s claim, at most ``MAX_HOLDER_CHARS`` bytes read; None if absent."""

    @abstractmethod
    def _create_run_doc(self, generation: int, data: bytes) -> bool:
        """Store run document ``generation`` as ``data`` only if it does not exist yet (whole or not at all);
        whether this call created it."""

    @abstractmethod
    def _get_run_doc(self, generation: int) -> bytes | None:
        """Run document ``generation``, at most ``MAX_RUN_DOC_BYTES + 1`` bytes; None if absent."""


class _Memory:
    """The records of a :class:`LocalStore` and the condition its waiters sleep on."""

    def __init__(self) -> None:
        self.data: dict[tuple[int, str], bytes] = {}
        self.claims: dict[str, bytes] = {}
        self.run_docs: dict[int, bytes] = {}
        self.version = 0  # publishes so far: a waiter compares it to see one it would have missed
        self.cond = threading.Condition()


class LocalStore(ExchangeStore):
    """In-process backend: every agent under one controller (today's path) behind the same interface.

    Records are kept as the same checked JSON bytes the other backends store, so a record that
    passes here passes everywhere; a publish wakes a waiting thread at once instead of a poll.
    ``share_with``: another LocalStore of the same run whose records this one shares (one store
    object per agent, as each job has its own in the other backends).
    """

    backend = "local"

    def __init__(self, run_id: str, *, key: bytes | None = None, limits: Limits = DEFAULT_LIMITS,
                 share_with: LocalStore | None = None) -> None:
        super().__init__(run_id, key=key, limits=limits)
        if share_with is not None and share_with.run_id != self.run_id:
            raise ValueError(f"LocalStore: cannot share run {share_with.run_id!r}'s records with run {self.run_id!r}")
        self._mem = share_with._mem if share_with is not None else _Memory()

    def _put(self, step: int, agent: str, data: bytes) -> None:
        with self._mem.cond:
            self._mem.data[(step, agent)] = data
            self._mem.version += 1
            self._mem.cond.notify_all()

    def _get(self, step: int, agent: str) -> tuple[bytes, str] | None:
        with self._mem.cond:
            data = self._mem.data.get((step, agent))
        return None if data is None else (data, f"local step {step}")

    def _steps(self, agent: str) -> list[int]:
        with self._mem.cond:
            return sorted(s for s, a in self._mem.data if a == agent)

    def _delete(self, step: int, agent: str) -> None:
        with self._mem.cond:
            self._mem.data.pop((step, agent), None)

    def _put_claim(self, agent: str, data: bytes) -> None:
        with self._mem.cond:
            self._mem.claims[agent] = data

    def _get_claim(self, agent: str) -> bytes | None:
        with self._mem.cond:
            return self._mem.claims.get(agent)

    def _create_run_doc(self, generation: int, data: bytes) -> bool:
        with self._mem.cond:
            return self._mem.run_docs.setdefault(generation, data) is data

    def _get_run_doc(self, generation: int) -> bytes | None:
        with self._mem.cond:
            return self._mem.run_docs.get(generation)

    def _poll_token(self) -> object:
        with self._mem.cond:
            return self._mem.version

    def _sleep(self, token: object, seconds: float) -> None:
        with self._mem.cond:  # returns at once if anything was published since the round of reads began
            self._mem.cond.wait_for(lambda: self._mem.version != token, seconds)
