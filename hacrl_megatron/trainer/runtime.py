"""One agent's runtime pieces: tokenizer, trainer (AgentHandle), rollout engine, prompt template.

Every agent starts from HF weights: a random init of its ``ModelConfig`` (seeded), an HF
directory (``model.hf_path``; "smollm2" for the bundled SmolLM2-135M-Instruct) or a warm-up
checkpoint (``init_checkpoint``). The same weights go into the trainer and into a separate copy
inside the rollout engine, which from then on only changes through weight sync.

The rollout engine is built from the seam of docs/architecture.md ("The engine seam"): the engine
clients ``rollout.engine`` names (``rollout/launch.py``) behind the transport ``rollout.weight_sync``
names (``sync/push.py``) in one :class:`~hacrl_megatron.rollout.engine_pool.EnginePool`; the
in-process HF engine alone when it copies the trainer's tensors itself (``inprocess``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hacrl_megatron.agents.handle import AgentHandle
from hacrl_megatron.config import AgentConfig, ExperimentConfig
from hacrl_megatron.config.validation_scale import require_context_parallel
from hacrl_megatron.data.prompts import format_prompt
from hacrl_megatron.exchange.tokenizers import load_tokenizer
from hacrl_megatron.models.resolved import (
    ResolvedAgent,
    resolve_agent,
    starting_weights_dir,  # noqa: F401  (re-exported: tests import it here)
)
from hacrl_megatron.rollout.engine_pool import EnginePool
from hacrl_megatron.rollout.launch import engine_root, start_engines
from hacrl_megatron.rollout.types import TrainingEngine
from hacrl_megatron.sync import make_transport, resolve_weight_sync, sync_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class AgentRuntime:
    """Agent ``index`` as a whole: its config, tokenizer, **trainer** (the training side of the agent: an
    ``agents.AgentHandle`` over its Megatron or HF model and optimizer, in this process or as Ray worker
    groups) and **engine** (its rollout engine or pool of engine servers, ``rollout/``)."""

    index: int
    cfg: AgentConfig
    tokenizer: PreTrainedTokenizerBase
    trainer: AgentHandle
    engine: TrainingEngine
    hf_config: PretrainedConfig | None = None  # the agent's transformers config (for HF exports)
    resolved: ResolvedAgent | None = None  # the record the agent was built from (models/resolved.py)
    _prompt_cache: dict[str, list[int]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.cfg.name

    def prompt_ids(self, question: str) -> list[int]:
        """This agent's templated prompt ids for ``question`` (docs/algorithm.md §6: its own template)."""
        if question not in self._prompt_cache:

            text = format_prompt(question, self.tokenizer, template=self.cfg.prompt_template)
            self._prompt_cache[question] = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._prompt_cache[question]

    def close(self) -> None:
        self.engine.close()  # SGLang servers and weight-sync groups
        self.trainer.close()  # Ray worker groups release their actors

    def sync_weights(self) -> int:
        """Push the trainer's HF-named weights into the rollout engine (docs/architecture.md, "Weight sync")."""

        return sync_weights(self.trainer, self.engine)


EXPECTED_CPU_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    ".*tp_group is None",
    "When using async grad allreduce",
)


def configure_process(exp: ExperimentConfig) -> None:
    """Seed, CPU threads, and quiet per-call progress bars of transformers (our bar shows progress)."""
    from transformers.utils import logging as hf_logging

    torch.manual_seed(exp.train.seed)
    if not torch.cuda.is_available():
        if exp.train.cpu_threads:
            torch.set_num_threads(exp.train.cpu_threads)
        # expected on CPU: megatron-core announces its torch fallbacks for TE/Apex at import
        for message in EXPECTED_CPU_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_hf_model(cfg: AgentConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """The agent's starting HF model (fp32 on CPU): warm-up checkpoint, HF dir, or seeded random init."""
    return load_starting_model(resolve_agent(cfg, vocab_size), seed)


def load_starting_model(agent: ResolvedAgent, seed: int) -> PreTrainedModel:
    """``agent``'s starting HF model in this process, in float32: its weights folder loaded with the
    config its record holds (``config.json`` is not read again), or a random init of its sizes
    seeded with ``seed``. The model carries its own copy of the config."""
    from transformers import AutoModelForCausalLM

    if agent.weights is not None:  # from_pretrained copies the config it is given
        return AutoModelForCausalLM.from_pretrained(str(agent.weights), config=agent.hf_config, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(copy.deepcopy(agent.hf_config), dtype=torch.float32)


def reads_weights_itself(exp: ExperimentConfig, cfg: AgentConfig) -> bool:
    """True when no HF model of agent ``cfg`` is needed in this process (docs/architecture.md, "No
    model on the controller"): it starts from an HF folder, its trainer is Megatron (whose ranks read
    their own shards of the safetensors) and its engines are servers (which load the folder
    themselves). The HF backend trains the model in this process, the in-process HF engine samples
    from it, a GGUF file is dequantised by transformers and a random init has no files to read:
    those load the model here."""
    return (cfg.backend == "megatron" and exp.rollout.engine != "hf" and cfg.model.gguf_file is None
            and (cfg.init_checkpoint or cfg.model.hf_path) is not None)


def uses_ray_workers(cfg: AgentConfig) -> bool:
    """The agent's ranks are Ray actors (``workers: ray``, or auto with more than one rank)."""
    return cfg.uses_ray_workers


def planned_trainer_spans(exp: ExperimentConfig, cfg: AgentConfig) -> list[tuple[int, int]] | None:
    """(node, ranks) of ``cfg``'s Ray ranks in rank order as the plan lays the job out
    (:func:`hacrl_megatron.launch.placement.node_plan`: trainers in config order on consecutive GPUs)
    on a launched multi-node job, whose nodes carry ``hacrl_node_<k>`` and whose GPUs per node
    ``$HACRL_GPUS_PER_NODE`` gives (an error when missing there); None elsewhere (Ray places the ranks)."""
    from hacrl_megatron.agents.ray_placement import ensure_ray
    from hacrl_megatron.launch.placement import node_plan
    from hacrl_megatron.ray_nodes import gpus_per_node, job_nodes

    ray = ensure_ray()
    nodes = job_nodes(ray)
    per_node = gpus_per_node(ray, f"agent {cfg.name!r}")
    if per_node is None or len(nodes) < 2:
        return None
    (planned,) = [a for a in node_plan(exp, max(nodes) + 1, per_node).agents if a.name == cfg.name]
    return [(node, count) for node, _, count in planned.spans]


def _check_context_parallel(agent: ResolvedAgent) -> None:
    """``parallel.cp > 1`` needs Transformer Engine on CUDA where the agent's ranks run: here for an
    in-process agent, and for Ray ranks unless this process joins (or already runs) a Ray cluster with
    GPUs, whose ranks check their own machines (agents/local.py). Refused in one line naming the key,
    before any rank or private Ray cluster starts."""
    cp = agent.cfg.parallel.cp
    if cp <= 1:
        return
    if uses_ray_workers(agent.cfg):
        from hacrl_megatron.agents.ray_placement import _starts_private_cluster, require_ray

        ray = require_ray()
        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
            return  # GPU nodes: each rank checks its own machine
        if not ray.is_initialized() and not _starts_private_cluster(None):
            return  # an existing cluster is joined later: its ranks check their machines
    # this machine runs the ranks (in-process, or a private Ray cluster of this machine, or a GPU-less one)
    require_context_parallel(cp, f"agents.{agent.index}.parallel.cp")


def build_agent(agent: ResolvedAgent, model: PreTrainedModel | Path, exp: ExperimentConfig,
                total_updates: int) -> AgentHandle:
    """The AgentHandle for ``agent``'s backend initialised from ``model``'s weights: an HF model in this
    process, or (Megatron agents, :func:`reads_weights_itself`) the path of an HF folder, whose
    safetensors the agent reads itself (each Ray rank its own shards). Megatron agents take the
    record's spec and config (its ranks too); nothing reads the config again."""
    # the weights already are the starting point (init_checkpoint or hf_path): the agent copies or reads
    # them (the HF backend trains ``model`` itself; the engine takes its own copy or folder)
    cfg, t = dataclasses.replace(agent.cfg, init_checkpoint=None), exp.train
    _check_context_parallel(agent)
    if cfg.backend == "hf":
        from hacrl_megatron.agents.hf import HFAgent

        return HFAgent(cfg.name, model, lr=cfg.lr, train_cfg=t, total_updates=total_updates)
    folder = isinstance(model, Path)
    if uses_ray_workers(cfg):
        from hacrl_megatron.agents.ray_agent import RayAgent, build_ray_agent

        spans = planned_trainer_spans(exp, cfg)
        if folder:
            return RayAgent(cfg, t, hf_checkpoint=str(model), hf_config=agent.hf_config, total_updates=total_updates,
                            node_spans=spans, resolved=agent)
        return build_ray_agent(cfg, model, t, total_updates, node_spans=spans, resolved=agent)
    from hacrl_megatron.agents.local import LocalAgent

    if folder:
        return LocalAgent(cfg, t, hf_checkpoint=str(model), hf_config=agent.hf_config, total_updates=total_updates,
                          resolved=agent)
    return LocalAgent.from_hf_model(cfg, model, train_cfg=t, total_updates=total_updates)


def build_engine(exp: ExperimentConfig, agent: ResolvedAgent, model: PreTrainedModel | Path,
                 tokenizer: PreTrainedTokenizerBase, trainer: AgentHandle) -> TrainingEngine:
    """``agent``'s rollout engine on ``model``'s weights (an HF model, or an HF folder for server
    engines): its clients (``rollout.engine``) in a pool
    behind the transport ``rollout.weight_sync`` names, or the one in-process HF engine itself
    (``inprocess``). A Ray agent's ranks broadcast themselves with the distributed transport."""
    r = exp.rollout  # colocated servers placed by Ray go where the agent's ranks are (rollout/engine_actor.py)
    shares_ranks = r.colocate and r.engine == "sglang" and r.sglang.placement == "ray"
    started = start_engines(exp, agent, model, tokenizer, getattr(trainer, "placement", None) if shares_ranks else None)
    if resolve_weight_sync(exp.rollout) == "inprocess":  # the HF engine copies the trainer's tensors itself
        (engine,) = started.clients
        return engine
    try:
        transport = make_transport(exp.rollout, agent.name, engine_root(exp, agent.name) / "synced", started.model_dir,
                                   ranks=trainer if uses_ray_workers(agent.cfg) else None)
        return EnginePool(started.clients, transport, colocate=exp.rollout.colocate, name=agent.name)
    except BaseException:
        for client in started.clients:
            client.close()
        raise


def build_runtime(exp: ExperimentConfig, index: int, total_updates: int,
                  agent_cfg: AgentConfig | None = None) -> AgentRuntime:
    """Agent ``index`` of ``exp`` (or ``agent_cfg`` in its place, e.g. with the warm-up learning rate).

    The agent is resolved first (:func:`~hacrl_megatron.models.resolved.resolve_agent`: the one read
    of its HF config, ``model.dtype`` resolved) and that record is what the model load, the trainer
    and the engines are built from. The starting weights are an HF model loaded here, or, when
    :func:`reads_weights_itself`, the HF folder alone: this process then holds the agent's config and
    tokenizer only, the trainer reads the folder's safetensors and the engines load the folder
    (linked into their init folder, in its stored dtype)."""
    cfg = agent_cfg or exp.agents[index]
    tokenizer = load_tokenizer(cfg.tokenizer)
    agent = resolve_agent(cfg, len(tokenizer), index=index, engine=exp.rollout.engine)
    weights: PreTrainedModel | Path
    if reads_weights_itself(exp, cfg):
        weights, hf_config = agent.weights, agent.hf_config
    else:
        weights = load_starting_model(agent, seed=exp.train.seed * 1000 + index)
        hf_config = weights.config
    trainer = build_agent(agent, weights, exp, total_updates)
    try:
        engine = build_engine(exp, agent, weights, tokenizer, trainer)
    except BaseException:
        trainer.close()  # a Ray agent's actors
        raise
    return AgentRuntime(index=index, cfg=cfg, tokenizer=tokenizer, trainer=trainer, engine=engine, hf_config=hf_config,
                        resolved=agent)


def export_hf(rt: AgentRuntime, out_dir: Path) -> Path:
    """Write the agent as a standalone HF folder (weights, config, tokenizer) for deployment, atomically."""
    from hacrl_megatron.models.convert import save_hf_checkpoint
    from hacrl_megatron.paths import atomic_save_dir

    tied = bool(getattr(rt.hf_config, "tie_word_embeddings", False))
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):  # the agent's tokenizer, not the config class's
        setattr(rt.hf_config, key, getattr(rt.tokenizer, key, None))  # defaults: generate() must stop at its end
    stream = ((name, t) for name, t in rt.trainer.export_hf_weights() if not (tied and name == "lm_head.weight"))

    def save(tmp: Path) -> None:
        save_hf_checkpoint(stream, rt.hf_config, str(tmp))
        rt.tokenizer.save_pretrained(tmp)

    atomic_save_dir(out_dir, save, replace=True)
    return out_dir
