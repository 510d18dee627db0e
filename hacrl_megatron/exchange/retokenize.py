"""Re-tokenization of trajectories into each learner's view, and its statistics (docs/algorithm.md §6).

Self records keep the source ids; cross records are decoded to text (special tokens skipped, no
clean-up of spaces) and re-encoded with the learner's tokenizer (no special tokens added), after
the learner's own templated prompt. End of sequence (``eos_mode``, cross records only):

- ``"learner_eos"`` (default): append the learner's eos iff the source stopped by itself;
- ``"source_eos_text"``: append the source's eos *string* encoded as ordinary text;
- ``"no_eos"``: never train an eos on cross records.

``"strip_all"`` drops the eos from every record, self records included (the first released version of
the reference code strips it from all responses before training): no learner is trained to stop.

Otherwise self records append the learner's eos when finish_reason == "eos": the engine returns ids
without it (:class:`~hacrl_megatron.rollout.Completion`) and the agent must learn to stop, exactly
as in single-agent GSPO. Prompts are left-truncated to ``max_prompt_len``, responses
right-truncated to ``max_response_len`` (an eos that no longer fits is dropped); every truncation is
counted per (source, learner) pair by :class:`ExchangeStats`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hacrl_megatron.exchange.records import LearnerView, Trajectory
from hacrl_megatron.exchange.tokenizers import tokenizer_fingerprint

EOS_MODES = ("learner_eos", "source_eos_text", "no_eos", "strip_all")


def decode_response(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Text of response ids as the exchange sees it: special tokens skipped, spaces untouched."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def encode_text(tokenizer: Any, text: str, *, split_special_tokens: bool = False) -> list[int]:
    """Ids of ``text`` with no bos/eos added (docs/algorithm.md §6: "no special tokens added")."""
    kwargs = {"split_special_tokens": True} if split_special_tokens else {}
    return list(tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"])


def batch_decode(tokenizer: Any, batch: list[list[int]]) -> list[str]:
    """:func:`decode_response` for many sequences; the Rust backend directly when there is one
    (transformers' per-id Python conversion costs more than the decoding itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [decode_response(tokenizer, ids) for ids in batch]
    # The backend never applies clean_up_tokenization_spaces: equal to decode_response.
    return backend.decode_batch(batch, skip_special_tokens=True)


def _batch_encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """:func:`encode_text` for many texts (no special tokens added), batched in the backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [encode_text(tokenizer, t) for t in texts]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


@dataclass
class _PairCounts:
    n: int = 0
    ratio_sum: float = 0.0
    ratio_n: int = 0
    truncated_prompt: int = 0
    truncated_response: int = 0
    roundtrip_mismatch: int = 0


class ExchangeStats:
    """Per (source, learner) pair counters of the re-tokenization (docs/algorithm.md §6: "count and report").

    token_ratio: mean over records of (learner response tokens / source response tokens), both
    without eos — the density of the learner's tokenizer on the source's text. roundtrip_mismatch:
    records whose text does not survive the learner's ``decode(encode(text))`` (characters the
    learner cannot represent). Not thread-safe; one instance per trainer step is the intended use.
    """

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], _PairCounts] = defaultdict(_PairCounts)

    def record(
        self,
        source: str,
        learner: str,
        *,
        source_tokens: int,
        learner_tokens: int,
        truncated_prompt: bool,
        truncated_response: bool,
        roundtrip_mismatch: bool,
    ) -> None:
        c = self._pairs[(source, learner)]
        c.n += 1
        if source_tokens > 0:
            c.ratio_sum += learner_tokens / source_tokens
            c.ratio_n += 1
        c.truncated_prompt += int(truncated_prompt)
        c.truncated_response += int(truncated_response)
        c.roundtrip_mismatch += int(roundtrip_mismatch)

    def pairs(self) -> list[tuple[str, str]]:
        return sorted(self._pairs)

    def get(self, source: str, learner: str) -> dict[str, float]:
        """Metrics of one pair: n, token_ratio, truncated_prompt, truncated_response, roundtrip_mismatch."""
        if (source, learner) not in self._pairs:
            raise KeyError(f"ExchangeStats: no records for source={source!r} learner={learner!r}; have {self.pairs()}")
        c = self._pairs[(source, learner)]
        return {
            "n": float(c.n),
            "token_ratio": c.ratio_sum / c.ratio_n if c.ratio_n else float("nan"),
            "truncated_prompt": float(c.truncated_prompt),
            "truncated_response": float(c.truncated_response),
            "roundtrip_mismatch": float(c.roundtrip_mismatch),
        }

    def as_metrics(self, prefix: str = "") -> dict[str, float]:
        """Flat ``{prefix}{learner}/exchange/from_{source}/{metric}`` → value (namespaced per learner)."""
        out: dict[str, float] = {}
        for source, learner in self.pairs():
            for key, value in self.get(source, learner).items():
                out[f"{prefix}{learner}/exchange/from_{source}/{key}"] = value
        return out

    def reset(self) -> None:
        self._pairs.clear()


class Exchange:
    """All agents' tokenizers; builds every learner's views of a step's trajectories.

    Fingerprints are computed once here, so identical tokenizers (e.g. two SmolLM2 agents) keep
    source ids verbatim while different ones re-encode text (docs/algorithm.md §6). ``remote``: agents
    trained by other jobs (``hacrl train --agent``), whose tokenizers this process does not hold: their
    trajectories arrive as text (:attr:`Trajectory.is_remote`) and every learner here re-encodes it.
    """

    def __init__(self, tokenizers: Mapping[str, Any], *, eos_mode: str = "learner_eos",
                 max_prompt_len: int, max_response_len: int, remote: Sequence[str] = ()) -> None:
        if eos_mode not in EOS_MODES:
            raise ValueError(f"Exchange: eos_mode={eos_mode!r} must be one of {list(EOS_MODES)}")
        for name, value in (("max_prompt_len", max_prompt_len), ("max_response_len", max_response_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Exchange: {name}={value!r} must be an integer >= 1")
        self.tokenizers = dict(tokenizers)
        self.eos_mode = eos_mode
        self.max_prompt_len = max_prompt_len
        self.max_response_len = max_response_len
        self._fingerprints = {name: tokenizer_fingerprint(tok) for name, tok in self.tokenizers.items()}
        self.remote = frozenset(remote)
        if self.remote & self.tokenizers.keys():
            raise ValueError(f"Exchange: agents {sorted(self.remote & self.tokenizers.keys())} are both local and remote")
        if self.remote and eos_mode == "source_eos_text":
            raise ValueError("Exchange: eos_mode='source_eos_text' needs every source's tokenizer; agents "
                             f"{sorted(self.remote)} train in other jobs")
        self.stats = ExchangeStats()

    def pop_metrics(self, prefix: str = "") -> dict[str, float]:
        """:meth:`ExchangeStats.as_metrics` of everything recorded since the last call, then reset
        (one call per step gives per-step numbers)."""
        out = self.stats.as_metrics(prefix)
        self.stats.reset()
        return out

    def same_tokenizer(self, a: str, b: str) -> bool:
        return self._fingerprints[self._check(a)] == self._fingerprints[self._check(b)]

    def _check(self, name: str) -> str:
        if name not in self.tokenizers:
            raise KeyError(f"Exchange: unknown agent {name!r}; known: {sorted(self.tokenizers)}")
        return name

    def views(self, learner: str, trajectories: Sequence[Trajectory],
              prompt_ids: Mapping[str, Sequence[int]], *, record_stats: bool = True) -> list[LearnerView]:
        """Learner ``learner``'s view of each trajectory (same order; docs/algorithm.md §6).

        ``prompt_ids`` maps ``prompt_id`` → the learner's templated prompt ids. ``record_stats``:
        count these views in :attr:`stats` (pass False for a second pass over the same records,
        e.g. the old-log-prob forward before the learner batch). Cross records are
        decoded and re-encoded in one batched tokenizer call per source (the Rust tokenizers
        parallelise it), which matters at B·G·(n−1) responses of thousands of tokens per step.
        """
        self._check(learner)
        for traj in trajectories:
            if traj.is_remote != (traj.source in self.remote):
                raise ValueError(f"Exchange.views: agent {traj.source!r}'s trajectory is "
                                 f"{'text only' if traj.is_remote else 'tokenized'}, but the agent is "
                                 f"{'remote' if traj.source in self.remote else 'local'} here")
            if traj.prompt_id not in prompt_ids:
                raise KeyError(f"Exchange.views: no learner prompt ids for prompt_id={traj.prompt_id!r}")
        encoded = self._encode_cross(learner, trajectories)
        stats = self.stats if record_stats else None
        return [self._view(traj, learner, prompt_ids[traj.prompt_id], encoded.get(i), stats)
                for i, traj in enumerate(trajectories)]

    def _keeps_ids(self, traj: Trajectory, learner: str) -> bool:
        """Self records, and cross records between identical tokenizers, keep the sampled ids (a peer
        job's records have none: their text is always re-encoded)."""
        if traj.is_remote:
            return False
        return traj.source == learner or self.same_tokenizer(self._check(traj.source), learner)

    def _view(self, traj: Trajectory, learner: str, prompt_ids: Sequence[int],
              encoded: tuple[list[int], bool] | None, stats: ExchangeStats | None) -> LearnerView:
        """Prompt + response ids (+ end tokens), truncated, recorded in ``stats``: one view.

        ``encoded``: (learner content ids, round-trip mismatch) of a re-encoded cross record; None
        keeps the source ids.
        """
        response, mismatch = encoded if encoded is not None else (list(traj.token_ids), False)
        tail, learner_eos = self._end_ids(traj, learner)
        full = response + tail
        truncated_response = len(full) > self.max_response_len
        full = full[:self.max_response_len]
        prompt = [int(t) for t in prompt_ids]
        truncated_prompt = len(prompt) > self.max_prompt_len
        if truncated_prompt:
            prompt = prompt[-self.max_prompt_len:]  # left-truncate: the question's end sits next to the answer
        if stats is not None:
            stats.record(traj.source, learner, source_tokens=traj.num_tokens, learner_tokens=len(response),
                         truncated_prompt=truncated_prompt, truncated_response=truncated_response,
                         roundtrip_mismatch=mismatch)
        return LearnerView(
            input_ids=tuple(prompt) + tuple(full),  # ids from tokenizers and Trajectory are already ints
            prompt_len=len(prompt),
            response_len=len(full),
            response_mask=(0,) * len(prompt) + (1,) * len(full),
            truncated_prompt=truncated_prompt,
            truncated_response=truncated_response,
            eos_appended=learner_eos and not truncated_response,
        )

    def _end_ids(self, traj: Trajectory, learner: str) -> tuple[list[int], bool]:
        """Ids that end the learner's view (docs/algorithm.md §6 end rule), and whether they are the learner's eos."""
        if traj.finish_reason != "eos" or self.eos_mode == "strip_all":
            return [], False  # truncated at the token budget (or every eos stripped): nothing to learn about stopping
        learner_tok = self.tokenizers[learner]
        eos = learner_tok.eos_token_id
        if eos is None:
            raise ValueError(f"Exchange: learner {learner!r}'s tokenizer has no eos_token_id")
        keep_ids = self._keeps_ids(traj, learner)
        if traj.source == learner or self.eos_mode == "learner_eos" or (keep_ids and self.eos_mode == "source_eos_text"):
            return [int(eos)], True  # with one shared tokenizer the source eos text *is* the learner eos
        if self.eos_mode == "no_eos":
            return [], False
        source_eos = self.tokenizers[traj.source].eos_token
        if source_eos is None:
            raise ValueError(f"Exchange: eos_mode='source_eos_text' needs an eos_token in source {traj.source!r}'s "
                             "tokenizer")
        # split_special_tokens: the source's eos string is plain text for the learner, never its specials.
        return encode_text(learner_tok, source_eos, split_special_tokens=True), False

    def _encode_cross(self, learner: str, trajectories: Sequence[Trajectory]) -> dict[int, tuple[list[int], bool]]:
        """index → (learner content ids, round-trip mismatch) for every record that needs re-encoding."""
        tok = self.tokenizers[learner]
        by_source: dict[str, list[int]] = defaultdict(list)
        for i, traj in enumerate(trajectories):
            if not self._keeps_ids(traj, learner):
                by_source[traj.source].append(i)
        out: dict[int, tuple[list[int], bool]] = {}
        for source, idx in by_source.items():
            if source in self.remote:  # the author's own decoding travelled with the record
                texts = [trajectories[i].response_text for i in idx]
            else:
                texts = batch_decode(self.tokenizers[source], [list(trajectories[i].token_ids) for i in idx])
            ids = _batch_encode(tok, texts)
            back = batch_decode(tok, ids)
            for i, text, enc, dec in zip(idx, texts, ids, back, strict=True):
                out[i] = (list(enc), dec != text)
        return out
