"""HF transformers rollout engine: batched ``generate`` on CPU (tests, demo) or a single GPU.

Batching: every prompt is repeated ``n`` times, the batch is left-padded and the attention mask is
built from the true prompt lengths (never from ``ids != pad``: SmolLM2's pad id equals its eos).
A response ends at the first eos or stop id; that id is not part of ``Completion.token_ids``.
Sampling uses a fresh ``GenerationConfig`` (top_k disabled, no repetition penalty) so samples
come from exactly softmax(logits / T) restricted by top_p — the distribution whose log-probs the
trainer recomputes (docs/algorithm.md §3). Models built from ``transformers`` are imported lazily.

The engine is also an :class:`~hacrl_megatron.rollout.protocol.EngineClient` that loads weights
from disk (:class:`~hacrl_megatron.rollout.protocol.DiskWeightLoader`), so several of them can sit
behind one :class:`~hacrl_megatron.rollout.engine_pool.EnginePool` with the disk transport
(``rollout.engine: hf``, ``rollout.weight_sync: disk``). Seeded sampling draws from torch's
process-wide generator, so engines of one process take turns while they sample with a seed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hacrl_megatron.rollout.protocol import EngineError, StartedEngines
from hacrl_megatron.rollout.types import Completion, SamplingParams

if TYPE_CHECKING:
    from hacrl_megatron.config import AgentConfig, ExperimentConfig

logger = logging.getLogger(__name__)
# torch's generator is process-wide: two engines seeding it from two threads (an EnginePool sends
# every engine its share at once) would interleave their draws
_SEEDED_RNG = threading.Lock()


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Seed torch's RNGs for the block without disturbing the caller's RNG state afterwards."""
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with _SEEDED_RNG, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _first_stop(ids: list[int], stop_ids: set[int]) -> int | None:
    for i, t in enumerate(ids):
        if t in stop_ids:
            return i
    return None


class HFEngine:
    """A :class:`~hacrl_megatron.rollout.RolloutEngine` over an in-process HF causal LM.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` with ``generate`` (put in eval mode here).
        tokenizer: its tokenizer (eos required; pad falls back to eos).
        max_batch_size: sequences per ``generate`` call (prompts × n are split into chunks).
        name: label in metrics when the engine sits in a pool (``engine0``, ...).
    """

    runs_in_process = True  # computes in this process, on torch's process-wide RNG (trainer/concurrency.py)

    def __init__(self, model: Any, tokenizer: Any, *, max_batch_size: int = 64, name: str = "engine0") -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("HFEngine: tokenizer has no eos_token_id; rollouts could never stop")
        if max_batch_size < 1:
            raise ValueError(f"HFEngine: max_batch_size={max_batch_size} must be >= 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.max_batch_size = max_batch_size
        self.name = name
        self._tokens = 0
        self._seconds = 0.0
        self._sequences = 0
        self._weight_loads = 0
        self.weight_version = 0  # the last version loaded by update_weights_from_disk

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ----------------------------------------------------------------------------------------
    # generation

    def _generation_config(self, params: SamplingParams) -> Any:
        from transformers import GenerationConfig

        # Every field that could reshape the distribution is set explicitly: transformers fills
        # unset (None) fields from the model's generation_config (e.g. Qwen3 ships top_k=20,
        # top_p=0.95), and RL needs samples from exactly softmax(logits / T) (+ top_p).
        kwargs: dict[str, Any] = dict(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            eos_token_id=[self.eos_id, *params.stop_token_ids],
            pad_token_id=self.pad_id,
            do_sample=not params.greedy,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            top_k=0,
            min_p=0.0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            num_beams=1,
        )
        # Greedy: neutral values keep the model's (unused) sampling defaults from being copied in.
        kwargs.update(temperature=1.0 if params.greedy else float(params.temperature),
                      top_p=1.0 if params.greedy else float(params.top_p))
        if params.stop:
            kwargs["stop_strings"] = list(params.stop)
        return GenerationConfig(**kwargs)

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if p:
                ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[i, width - len(p):] = 1
        extra = {"tokenizer": self.tokenizer} if params.stop else {}
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                generation_config=self._generation_config(params), **extra,
            )
        return [self._completion(row, params) for row in out[:, width:].tolist()]

    def _completion(self, new_ids: list[int], params: SamplingParams) -> Completion:
        cut = _first_stop(new_ids, {self.eos_id, *params.stop_token_ids})
        ids = new_ids if cut is None else new_ids[:cut]
        if cut is None:
            reason = "length"
        else:
            reason = "eos" if new_ids[cut] == self.eos_id else "stop"
        hit = False
        if params.stop:
            # A stop string wins over a later eos/stop id: after it HF pads the row, and a pad
            # equal to eos (SmolLM2) must not be mistaken for the model choosing eos.
            ids, hit = self._cut_at_stop_string(ids, params.stop)
            if hit:
                reason = "stop"
        self._tokens += len(ids) + (1 if cut is not None and not hit else 0)  # + the sampled eos/stop id
        return Completion(token_ids=tuple(ids), text=self._decode(ids), finish_reason=reason)

    def _cut_at_stop_string(self, ids: list[int], stops: tuple[str, ...]) -> tuple[list[int], bool]:
        """Shortest prefix whose text contains a stop string, and whether one was found."""
        if not any(s in self._decode(ids) for s in stops):
            return ids, False
        for end in range(1, len(ids) + 1):
            if any(s in self._decode(ids[:end]) for s in stops):
                return ids[:end], True
        return ids, False  # unreachable: the full text contains a stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """``params.n`` completions per prompt; ``out[i][j]`` is sample j of prompt i."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"HFEngine.generate: params must be SamplingParams, got {type(params).__name__}")
        for i, p in enumerate(prompt_token_ids):
            if len(p) == 0:
                raise ValueError(f"HFEngine.generate: prompt {i} is empty; a causal LM needs >= 1 token")
        flat = [list(p) for p in prompt_token_ids for _ in range(params.n)]
        start = time.perf_counter()
        results: list[Completion] = []
        with _seeded(params.seed):
            for lo in range(0, len(flat), self.max_batch_size):
                results.extend(self._generate_chunk(flat[lo: lo + self.max_batch_size], params))
        self._seconds += time.perf_counter() - start
        self._sequences += len(flat)
        return [results[i * params.n: (i + 1) * params.n] for i in range(len(prompt_token_ids))]

    def generate_seeded(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                        seeds: list[int] | None) -> list[list[Completion]]:
        """:meth:`generate` with sample j of prompt i drawn under its own seed ``seeds[i · n + j]``
        (``len(prompts) · n`` of them; None: :meth:`generate` as is, for greedy decoding).

        Each seeded sample is one ``generate`` call of batch 1, so a sample never depends on which
        other samples share its call (what :class:`~hacrl_megatron.rollout.engine_pool.EnginePool`
        needs to spread prompts freely); that costs one call per sample.
        """
        if seeds is None:
            return self.generate(prompt_token_ids, params)
        n = params.n
        if len(seeds) != len(prompt_token_ids) * n:
            raise ValueError(f"HFEngine.generate_seeded: {len(seeds)} seeds for {len(prompt_token_ids)} prompts × n={n}")
        one = dataclasses.replace(params, n=1)
        flat = [self.generate([prompt], dataclasses.replace(one, seed=seeds[i * n + j]))[0][0]
                for i, prompt in enumerate(prompt_token_ids) for j in range(n)]
        return [flat[i * n: (i + 1) * n] for i in range(len(prompt_token_ids))]

    # ----------------------------------------------------------------------------------------
    # weights and stats

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named full tensors into the model in place; returns how many were copied.

        Every name must be a parameter or buffer of the model and every shape must match (the
        error names the tensor). With tied embeddings ``lm_head.weight`` and
        ``model.embed_tokens.weight`` are one tensor: either name updates it, and if both come in
        one call they must be equal (an untied export into a tied engine is a conversion bug).
        """
        from hacrl_megatron.models.convert_moe import module_layout

        # an MoE export names experts one by one (checkpoint layout); transformers >= 5 holds them fused
        named_tensors = module_layout(named_tensors, self.model)
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        seen: dict[int, tuple[str, torch.Tensor]] = {}
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    raise KeyError(f"HFEngine.load_weights: {name!r} is not a parameter of the engine's model "
                                   f"({type(self.model).__name__}, {len(targets)} names)")
                target = targets[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"HFEngine.load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(target.shape)}")
                key = target.data_ptr()
                if key in seen and not torch.equal(seen[key][1].to(tensor.device, tensor.dtype), tensor):
                    raise ValueError(f"HFEngine.load_weights: {name!r} and {seen[key][0]!r} are tied in the "
                                     "engine's model but arrived with different values")
                seen[key] = (name, tensor)
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                count += 1
        self._weight_loads += 1
        return count

    def sync_from(self, export: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> int:
        """:meth:`load_weights` of ``export()`` (an in-process model never needs a restore)."""
        return self.load_weights(export())

    def update_weights_from_disk(self, folder: str, version: int) -> None:
        """:meth:`load_weights` of every tensor in the safetensors files of ``folder``, file by file
        (``sync/disk.py``'s version folders); ``version`` is recorded as :attr:`weight_version`."""
        from safetensors.torch import load_file

        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise EngineError(f"HFEngine {self.name}: no *.safetensors files in {folder}")
        for f in files:
            self.load_weights(load_file(str(f)).items())
        self.weight_version = int(version)

    def sequence_logprob(self, prompt_ids: list[int], response_ids: list[int]) -> float:
        """Σ log π(response | prompt) at temperature 1 (nats): :func:`hf_sequence_logprob`."""
        return hf_sequence_logprob(self.model, prompt_ids, response_ids)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Nothing: the in-process model is not a separate server holding its own GPU memory."""

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Nothing (see :meth:`release_memory`)."""

    def health(self) -> bool:
        """True: a model in this process answers as long as the process runs."""
        return True

    def alive(self) -> bool:
        """True (see :meth:`health`)."""
        return True

    def restart(self) -> None:
        """An in-process model has no server to restart (it never becomes unreachable)."""
        raise EngineError(f"HFEngine {self.name}: an in-process engine cannot be restarted")

    def close(self) -> None:
        """Nothing to stop."""

    def stats(self) -> dict[str, Any]:
        """tokens (generated, incl. the eos/stop token that ended a response), seconds, tokens_per_s,
        sequences, weight_loads, restarts (always 0)."""
        return {
            "tokens": self._tokens,
            "seconds": self._seconds,
            "tokens_per_s": self._tokens / self._seconds if self._seconds > 0 else 0.0,
            "sequences": self._sequences,
            "weight_loads": self._weight_loads,
            "restarts": 0,
        }


def hf_sequence_logprob(model: Any, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> float:
    """Σ_t log softmax(logits_t / T)[y_t] over the response tokens (nats), one sequence.

    Used to check a weight sync: the trainer's log-prob of a response and the engine model's must
    agree. ``temperature`` must be > 0 (log-probs of greedy decoding are not defined).
    """
    if temperature <= 0:
        raise ValueError(f"hf_sequence_logprob: temperature={temperature} must be > 0")
    if not prompt_ids:
        raise ValueError("hf_sequence_logprob: prompt_ids is empty; the first response token needs context")
    if not response_ids:
        return 0.0
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long, device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    p = len(prompt_ids)
    # position t's logits predict token t + 1
    pred = logits[p - 1: p - 1 + len(response_ids)] / temperature
    logp = torch.log_softmax(pred, dim=-1)
    target = torch.tensor(list(response_ids), dtype=torch.long, device=device)
    return float(logp.gather(1, target[:, None]).sum())


def start_engines(exp: ExperimentConfig, agent_cfg: AgentConfig, model: Any, tokenizer: Any,
                  root: Path, hf_config: Any = None) -> StartedEngines:
    """``rollout.engine: hf`` (``rollout/launch.py``): one in-process engine on a copy of ``model``,
    which from then on changes only through weight sync; nothing is written under ``root`` (the
    model carries its config: ``hf_config`` is not needed)."""
    engine = HFEngine(copy.deepcopy(model), tokenizer, max_batch_size=exp.rollout.hf.max_batch_size)
    return StartedEngines([engine])
