"""The per-(step, agent) exchange record that crosses between separately run agents, as checked JSON.

An agent trained in its own job (its own allocation, cluster or site) needs from each peer only
what HACPO reads of another agent's rollouts, all of it tokenizer-neutral: per prompt, the peer's
G responses as text, their verified rewards R(y), the peer's π_old log-prob sum Σ_t log π^(j)_old
and its token count L_j (the source half of eq. 11), and the peer's positive rate for the
capability tracker. :class:`PeerRecord` holds exactly that, plus the run id, the step and the
weights version that sampled it (staleness checks in one-step-off and async modes).

On the wire a record is canonical JSON (sorted keys, ASCII) — data, never code: no pickle. Every
record read back is checked field by field (types, bounded sizes, finite numbers, the run id and
the step the reader expects, the author the reader expects) and, when a key is configured,
its HMAC-SHA256 signature (:mod:`.signing`); a record that fails any check raises
:class:`ExchangeRecordError`, one line naming the author, where it came from and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hacrl_megatron.errors import InputError
from hacrl_megatron.exchange.records import FINISH_REASONS, Trajectory
from hacrl_megatron.exchange.remote.signing import SIGNATURE_FIELD, sign, verify

FORMAT = "hacrl-exchange/2"
REWARD_RANGE = (0.0, 1.0)  # the shared verifier's rewards (a checker's data.reward_range is mapped onto it)
LOGP_ROUNDING_NATS = 1e-3  # a log-prob sum is <= 0; this much above 0 is accepted as float rounding
MIN_LOGP_PER_TOKEN = -1e4  # nats: far below any token of a real softmax, far above a value meant to break eq. 11
MAX_CHARS_PER_TOKEN = 256  # no tokenizer's token decodes to more characters (the longest are runs of spaces)
POSITIVE_RATE_TOLERANCE = 1e-6  # the author computes its rate as a float32 mean


class ExchangeRecordError(InputError):
    """A peer's record that cannot be used; the message names its author, origin and field."""


@dataclass(frozen=True)
class Limits:
    """Upper bounds a record must respect before any of it is used (a hostile or broken writer
    cannot make a reader allocate without bound).

    Fields:
        max_bytes: the serialised record, in bytes (checked before parsing).
        max_prompts: P, prompts per step.
        max_group: G, responses per prompt.
        max_text_chars: characters of one response text or one prompt id.
        max_tokens: L_j of one response (source tokens).
    """

    max_bytes: int = 64 << 20
    max_prompts: int = 4096
    max_group: int = 256
    max_text_chars: int = 1 << 20
    max_tokens: int = 1 << 20


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class PeerRecord:
    """One agent's rollouts of one step, as every other agent's job receives them.

    P = len(prompt_ids) prompts, each with G responses (G may differ per prompt, never 0).

    Fields:
        run_id: the run's id; every job of one run shares it (records of another run are refused).
        step: the training step the responses were sampled for (0-based).
        agent: the author's agent name (j in docs/algorithm.md).
        weights_version: the author's optimizer-step count of the weights that sampled the responses.
        prompt_ids: [P] ids of the shared prompts (every job samples the same prompts at a step).
        responses: [P][G] response texts, decoded by the author (special tokens skipped).
        finish_reasons: [P][G] "eos" (the author chose to stop) or "length" (cut at the budget);
            decides whether a learner's view ends with its eos (docs/algorithm.md §6).
        rewards: [P][G] the shared verifier's score R(y) of each response.
        logp_sums: [P][G] Σ_t log π^(j)_old(y_t | x, y_<t) in nats, at the rollout temperature.
        lengths: [P][G] L_j, the number of author tokens ``logp_sums`` covers.
        response_tokens: [P][G] the author's token count of each response, without its eos (counts,
            never ids: the learners' re-tokenization statistics compare their lengths to these).
        positive_rate: the author's share of responses with a positive reward this step, in [0, 1]
            (the capability tracker's input).
        config_digest: a digest of the configuration every job of the run must share
            (:func:`hacrl_megatron.trainer.run_identity.shared_config_digest`); a record of a job with
            another algorithm, data, reward or agent list is refused. "" where the writer checks none.
        config_fields: setting name → short digest of its value, the settings ``config_digest``
            covers, so that a reader names the setting two jobs disagree on. {} where the writer checks none.
        run_nonce: drawn by the run's first fresh job and shared by all of them (the exchange's run
            document); a reader refuses a record of another nonce (an earlier run of the same run id,
            replayed or left over). "" where the writer uses none.
    """

    run_id: str
    step: int
    agent: str
    weights_version: int
    prompt_ids: tuple[str, ...]
    responses: tuple[tuple[str, ...], ...]
    finish_reasons: tuple[tuple[str, ...], ...]
    rewards: tuple[tuple[float, ...], ...]
    logp_sums: tuple[tuple[float, ...], ...]
    lengths: tuple[tuple[int, ...], ...]
    response_tokens: tuple[tuple[int, ...], ...]
    positive_rate: float
    config_digest: str = ""
    config_fields: Mapping[str, str] = field(default_factory=dict)
    run_nonce: str = ""

    def __post_init__(self) -> None:
        _check_fields(self.to_dict(), self.agent, "constructor", DEFAULT_LIMITS)
        for name in ("prompt_ids", "responses", "finish_reasons", "rewards", "logp_sums", "lengths", "response_tokens"):
            value = getattr(self, name)  # freeze lists handed in: the record is immutable all the way down
            cast = {"rewards": float, "logp_sums": float, "lengths": int, "response_tokens": int}.get(name)
            frozen = (tuple(value) if name == "prompt_ids" else
                      tuple(tuple(cast(v) for v in g) if cast else tuple(g) for g in value))
            object.__setattr__(self, name, frozen)
        object.__setattr__(self, "positive_rate", float(self.positive_rate))
        object.__setattr__(self, "config_fields", MappingProxyType(dict(self.config_fields)))

    @property
    def num_responses(self) -> int:
        return sum(len(g) for g in self.responses)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (lists, str, int, float); the ``format`` tag included."""
        return {"format": FORMAT, "run_id": self.run_id, "step": self.step, "agent": self.agent,
                "weights_version": self.weights_version, "prompt_ids": list(self.prompt_ids),
                "responses": [list(g) for g in self.responses],
                "finish_reasons": [list(g) for g in self.finish_reasons],
                "rewards": [list(g) for g in self.rewards], "logp_sums": [list(g) for g in self.logp_sums],
                "lengths": [list(g) for g in self.lengths],
                "response_tokens": [list(g) for g in self.response_tokens], "positive_rate": self.positive_rate,
                "config_digest": self.config_digest, "config_fields": dict(self.config_fields),
                "run_nonce": self.run_nonce}

    def to_json(self, key: bytes | None = None) -> bytes:
        """Canonical JSON bytes, one field per line for readers, signed with ``key`` when given."""
        body = self.to_dict()
        if key is not None:
            body[SIGNATURE_FIELD] = sign(body, key)
        return _readable_json(body).encode()

    @classmethod
    def from_trajectories(cls, *, run_id: str, step: int, agent: str, weights_version: int,
                          prompt_ids: Sequence[str], trajectories: Sequence[Trajectory],
                          positive_rate: float, texts: Sequence[str] | None = None,
                          logp_sums: Sequence[float] | None = None, config_digest: str = "",
                          config_fields: Mapping[str, str] | None = None, run_nonce: str = "") -> PeerRecord:
        """Group ``agent``'s trajectories of one step by prompt, in ``prompt_ids`` order.

        Every trajectory must come from ``agent``, answer one of ``prompt_ids`` and carry its
        π_old log-prob sum (:meth:`Trajectory.with_logp`); each prompt needs at least one.
        ``texts``/``logp_sums`` (one per trajectory, same order) replace the trajectories' own
        ``response_text``/``source_logp_sum`` (the learners' decoding of the ids; Σ log π_behav of a
        batch that lags behind the author's weights).
        """
        n = len(trajectories)
        for name, values in (("texts", texts), ("logp_sums", logp_sums)):
            if values is not None and len(values) != n:
                raise ValueError(f"PeerRecord.from_trajectories: {len(values)} {name} for {n} trajectories")
        text_of = dict(zip(map(id, trajectories), texts if texts is not None else [t.response_text for t in trajectories]))
        logp_of = dict(zip(map(id, trajectories),
                           logp_sums if logp_sums is not None else [t.source_logp_sum for t in trajectories]))
        groups: dict[str, list[Trajectory]] = {pid: [] for pid in prompt_ids}
        for t in trajectories:
            if t.source != agent:
                raise ValueError(f"PeerRecord.from_trajectories: trajectory of {t.source!r} in {agent!r}'s record")
            if t.prompt_id not in groups:
                raise ValueError(f"PeerRecord.from_trajectories: prompt_id {t.prompt_id!r} is not in prompt_ids")
            groups[t.prompt_id].append(t)
        rows = [groups[pid] for pid in prompt_ids]
        return cls(run_id=run_id, step=step, agent=agent, weights_version=weights_version,
                   prompt_ids=tuple(prompt_ids), responses=tuple(tuple(text_of[id(t)] for t in g) for g in rows),
                   finish_reasons=tuple(tuple(t.finish_reason for t in g) for g in rows),
                   rewards=tuple(tuple(float(t.reward) for t in g) for g in rows),
                   logp_sums=tuple(tuple(float(logp_of[id(t)]) for t in g) for g in rows),
                   lengths=tuple(tuple(int(t.source_len) for t in g) for g in rows),
                   response_tokens=tuple(tuple(t.num_tokens for t in g) for g in rows), positive_rate=positive_rate,
                   config_digest=config_digest, config_fields=dict(config_fields or {}), run_nonce=run_nonce)


def parse_record(data: bytes, *, run_id: str, step: int, agent: str, origin: str, key: bytes | None = None,
                 limits: Limits = DEFAULT_LIMITS, run_nonce: str = "") -> PeerRecord:
    """Check ``data`` (one record's JSON bytes) and build the record, or raise :class:`ExchangeRecordError`.

    ``run_id``/``step``/``agent``: what the reader expects (the author is known from where the record
    was found, so a record that cannot even be parsed is still refused naming its author).
    ``origin``: where it was read (a file path, a Redis key), for the message. ``key``: the shared HMAC
    key; when given, a record without a valid signature is refused. ``run_nonce``: this run's nonce;
    when given, a record carrying another one is refused.
    """
    if len(data) > limits.max_bytes:
        # readers stop at max_bytes + 1 bytes, so the true size is not known here
        raise refusal(agent, origin, "record", f"larger than the limit of {limits.max_bytes} bytes")
    try:
        obj = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise refusal(agent, origin, "record", f"not valid JSON ({_first_line(err)})") from None
    if not isinstance(obj, dict):
        raise refusal(agent, origin, "record", f"a JSON {type(obj).__name__}, expected an object")
    if key is not None:
        problem = verify(obj, key)
        if problem:
            raise refusal(agent, origin, SIGNATURE_FIELD, problem)
    obj.pop(SIGNATURE_FIELD, None)  # unsigned readers ignore a signature they have no key for
    _check_fields(obj, agent, origin, limits)
    for name, want in (("run_id", run_id), ("step", step), ("agent", agent)):
        if obj[name] != want:
            raise refusal(agent, origin, name, f"{obj[name]!r}, expected {want!r}")
    if run_nonce and obj["run_nonce"] != run_nonce:
        raise refusal(agent, origin, "run_nonce", f"{obj['run_nonce']!r}, this run's is {run_nonce!r}: a record of an "
                                                  "earlier run of this run id (left over or replayed)")
    obj.pop("format")
    return PeerRecord(**obj)


def _check_fields(obj: dict[str, Any], agent: str, origin: str, limits: Limits) -> None:
    """Every field present, of its type, inside ``limits``, finite; nothing else. Raises one line."""
    expected = {"format", "run_id", "step", "agent", "weights_version", "prompt_ids", "responses",
                "finish_reasons", "rewards", "logp_sums", "lengths", "response_tokens", "positive_rate",
                "config_digest", "config_fields", "run_nonce"}
    missing, extra = sorted(expected - obj.keys()), sorted(obj.keys() - expected)
    if missing:
        raise refusal(agent, origin, missing[0], "missing")
    if extra:
        raise refusal(agent, origin, extra[0], "not a field of an exchange record")
    if obj["format"] != FORMAT:
        raise refusal(agent, origin, "format", f"{obj['format']!r}, expected {FORMAT!r}")
    for name in ("run_id", "agent"):
        _check_str(obj[name], agent, origin, name, 256)
    _check_str(obj["config_digest"], agent, origin, "config_digest", 128, allow_empty=True)
    _check_str(obj["run_nonce"], agent, origin, "run_nonce", 64, allow_empty=True)
    _check_config_fields(obj["config_fields"], agent, origin)
    for name in ("step", "weights_version"):
        _check_int(obj[name], agent, origin, name, 0, 1 << 62)
    _check_number(obj["positive_rate"], agent, origin, "positive_rate", 0.0, 1.0)
    prompts = obj["prompt_ids"]
    if not isinstance(prompts, (list, tuple)) or not 0 < len(prompts) <= limits.max_prompts:
        raise refusal(agent, origin, "prompt_ids", f"must be a list of 1..{limits.max_prompts} ids")
    for i, pid in enumerate(prompts):
        _check_str(pid, agent, origin, f"prompt_ids[{i}]", limits.max_text_chars)
    groups = obj["responses"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(prompts):
        raise refusal(agent, origin, "responses", f"must be a list of {len(prompts)} groups (one per prompt)")
    for p, group in enumerate(groups):
        if not isinstance(group, (list, tuple)) or not 0 < len(group) <= limits.max_group:
            raise refusal(agent, origin, f"responses[{p}]", f"must be a list of 1..{limits.max_group} texts")
        for g, text in enumerate(group):
            _check_str(text, agent, origin, f"responses[{p}][{g}]", limits.max_text_chars, allow_empty=True)
    _check_grids(obj, agent, origin, [len(g) for g in groups], limits)
    _check_consistency(obj, agent, origin)


def _check_grids(obj: dict[str, Any], agent: str, origin: str, shape: list[int], limits: Limits) -> None:
    """finish_reasons, rewards, logp_sums, lengths and response_tokens: the [P][G] shape of ``responses``,
    valid cells."""
    for name in ("finish_reasons", "rewards", "logp_sums", "lengths", "response_tokens"):
        grid = obj[name]
        if not isinstance(grid, (list, tuple)) or len(grid) != len(shape):
            raise refusal(agent, origin, name, f"must be a list of {len(shape)} groups (one per prompt)")
        for p, (row, size) in enumerate(zip(grid, shape)):
            if not isinstance(row, (list, tuple)) or len(row) != size:
                raise refusal(agent, origin, f"{name}[{p}]", f"must hold {size} values (one per response)")
            for g, value in enumerate(row):
                field = f"{name}[{p}][{g}]"
                if name == "finish_reasons":
                    if value not in FINISH_REASONS:
                        raise refusal(agent, origin, field, f"{value!r}, expected one of {list(FINISH_REASONS)}")
                elif name in ("lengths", "response_tokens"):
                    _check_int(value, agent, origin, field, 0, limits.max_tokens)
                elif name == "rewards":
                    _check_number(value, agent, origin, field, *REWARD_RANGE)
                else:
                    _check_number(value, agent, origin, field, -math.inf, LOGP_ROUNDING_NATS)


def _check_consistency(obj: dict[str, Any], agent: str, origin: str) -> None:
    """The numbers of each response agree with each other and with the record: L_j covers at most the
    response's tokens (+ its eos), a sum over L_j tokens lies in [L_j · MIN_LOGP_PER_TOKEN, 0] (0 for
    no token), the text is no longer than its tokens can decode to, the weights are no newer than the
    step, and the positive rate is the share of positive rewards (the capability tracker reads it)."""
    if obj["weights_version"] > obj["step"]:
        raise refusal(agent, origin, "weights_version", f"{obj['weights_version']} is newer than the record's step "
                                                        f"{obj['step']} (weights cannot sample before they exist)")
    for p, row in enumerate(obj["lengths"]):
        for g, length in enumerate(row):
            count, finish = obj["response_tokens"][p][g], obj["finish_reasons"][p][g]
            logp, chars = obj["logp_sums"][p][g], len(obj["responses"][p][g])
            if length > count + (finish == "eos"):
                raise refusal(agent, origin, f"lengths[{p}][{g}]", f"L_j {length} exceeds the response's {count} "
                                                                   f"tokens{' + eos' if finish == 'eos' else ''}")
            if logp < MIN_LOGP_PER_TOKEN * max(length, 1) or (length == 0 and logp != 0):
                raise refusal(agent, origin, f"logp_sums[{p}][{g}]",
                              f"{logp!r} over L_j={length} tokens; must lie in [{MIN_LOGP_PER_TOKEN:g} x L_j, 0] "
                              "(a log-probability sum; 0 over no token)")
            if chars > MAX_CHARS_PER_TOKEN * count:
                raise refusal(agent, origin, f"responses[{p}][{g}]",
                              f"{chars} characters from {count} tokens; at most {MAX_CHARS_PER_TOKEN} per token")
    rewards = [r for row in obj["rewards"] for r in row]
    share = sum(r > 0 for r in rewards) / len(rewards)
    if abs(obj["positive_rate"] - share) > POSITIVE_RATE_TOLERANCE:
        raise refusal(agent, origin, "positive_rate", f"{obj['positive_rate']!r}, but {share:g} of the record's "
                                                      "rewards are positive")


def _check_config_fields(fields: Any, agent: str, origin: str) -> None:
    if not isinstance(fields, dict) or len(fields) > 256:
        raise refusal(agent, origin, "config_fields", "must be a mapping of at most 256 settings")
    for name, value in fields.items():
        _check_str(name, agent, origin, "config_fields (a name)", 128)
        _check_str(value, agent, origin, f"config_fields[{name!r}]", 128)


def _check_str(value: Any, agent: str, origin: str, field: str, max_chars: int, allow_empty: bool = False) -> None:
    if not isinstance(value, str) or len(value) > max_chars or (not value and not allow_empty):
        shown = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise refusal(agent, origin, field, f"{shown}; must be a {'' if allow_empty else 'non-empty '}string of at "
                                           f"most {max_chars} characters")


def _check_int(value: Any, agent: str, origin: str, field: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise refusal(agent, origin, field, f"{value!r}; must be an integer in [{low}, {high}]")


def _check_number(value: Any, agent: str, origin: str, field: str, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise refusal(agent, origin, field, f"{value!r}; must be a finite number")
    if not low <= value <= high:
        raise refusal(agent, origin, field, f"{value!r}; must lie in [{low}, {high}]")


def _readable_json(body: dict[str, Any]) -> str:
    """Sorted-key ASCII JSON, one field per line and one prompt's group per line (diff- and grep-friendly)."""
    def dump(value: Any) -> str:
        return json.dumps(value, ensure_ascii=True, allow_nan=False)

    lines = []
    for name in sorted(body):
        value = body[name]
        if isinstance(value, list) and value and isinstance(value[0], list):
            value_text = "[\n" + ",\n".join(f"  {dump(row)}" for row in value) + "\n ]"
        else:
            value_text = dump(value)
        lines.append(f" {dump(name)}: {value_text}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _refuse_constant(name: str) -> float:
    """json's hook for NaN/Infinity literals: Python would accept them, the record format does not."""
    raise ValueError(f"non-finite literal {name}")


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def refusal(agent: str, origin: str, field: str, problem: str) -> ExchangeRecordError:
    """The one-line error for ``agent``'s record found at ``origin`` (also for a store's own checks)."""
    return ExchangeRecordError(f"exchange record of agent {agent!r} refused ({origin}): field {field!r}: {problem}")
