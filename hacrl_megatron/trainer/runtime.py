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

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hacrl_megatron.agents.handle import AgentHandle
from hacrl_megatron.config import AgentConfig, ExperimentConfig
from hacrl_megatron.data.prompts import format_prompt
from hacrl_megatron.exchange.tokenizers import load_tokenizer
from hacrl_megatron.models.smollm2 import smollm2_hf_dir
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


def starting_weights_dir(cfg: AgentConfig) -> Path | None:
    """The HF folder agent ``cfg`` starts from (``init_checkpoint``, else ``model.hf_path``; "smollm2"
    is the bundled model), or None for a seeded random init. Raises when the folder is missing."""
    source = cfg.init_checkpoint or cfg.model.hf_path
    if source is None:
        return None
    if source == "smollm2":
        return Path(smollm2_hf_dir())
    if not Path(source).is_dir():
        raise FileNotFoundError(f"agent {cfg.name!r}: model directory {source!r} does not exist")
    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"agent {cfg.name!r}: model directory {source!r} has no config.json "
                                "(not an HF model folder)")
    return Path(source)


def _check_vocab(cfg: AgentConfig, model_vocab: int, vocab_size: int) -> None:
    if model_vocab < vocab_size:
        raise ValueError(f"agent {cfg.name!r}: model vocab {model_vocab} < tokenizer vocab {vocab_size}")


def load_hf_model(cfg: AgentConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    """The agent's starting HF model (fp32 on CPU): warm-up checkpoint, HF dir, or seeded random init."""
    from transformers import AutoModelForCausalLM

    source = starting_weights_dir(cfg)
    if source is not None:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
        _check_vocab(cfg, model.config.vocab_size, vocab_size)
        return model
    from hacrl_megatron.models.provider import hf_config_from_model_config

    hf_config = hf_config_from_model_config(cfg.model, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


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
    return cfg.ray_workers


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


def build_agent(cfg: AgentConfig, model: PreTrainedModel | Path, exp: ExperimentConfig, total_updates: int,
                hf_config: PretrainedConfig | None = None) -> AgentHandle:
    """The AgentHandle for ``cfg.backend`` initialised from ``model``'s weights: an HF model in this
    process, or (Megatron agents, :func:`reads_weights_itself`) the path of an HF folder with its
    ``hf_config``, whose safetensors the agent reads itself (each Ray rank its own shards)."""
    t = exp.train
    if cfg.backend == "hf":
        from hacrl_megatron.agents.hf import HFAgent

        return HFAgent(cfg.name, model, lr=cfg.lr, train_cfg=t, total_updates=total_updates)
    folder = isinstance(model, Path)
    if uses_ray_workers(cfg):
        from hacrl_megatron.agents.ray_agent import RayAgent, build_ray_agent

        spans = planned_trainer_spans(exp, cfg)
        if folder:
            return RayAgent(cfg, t, hf_checkpoint=str(model), hf_config=hf_config, total_updates=total_updates,
                            node_spans=spans)
        return build_ray_agent(cfg, model, t, total_updates, node_spans=spans)
    from hacrl_megatron.agents.local import LocalAgent

    if folder:
        return LocalAgent(cfg, t, hf_checkpoint=str(model), hf_config=hf_config, total_updates=total_updates)
    return LocalAgent.from_hf_model(cfg, model, train_cfg=t, total_updates=total_updates)


def build_engine(exp: ExperimentConfig, cfg: AgentConfig, model: PreTrainedModel | Path,
                 tokenizer: PreTrainedTokenizerBase, agent: AgentHandle) -> TrainingEngine:
    """The agent's rollout engine on ``model``'s weights (an HF model, or an HF folder for server
    engines): its clients (``rollout.engine``) in a pool
    behind the transport ``rollout.weight_sync`` names, or the one in-process HF engine itself
    (``inprocess``). A Ray agent's ranks broadcast themselves with the distributed transport."""
    started = start_engines(exp, cfg, model, tokenizer)
    if resolve_weight_sync(exp.rollout) == "inprocess":  # the HF engine copies the trainer's tensors itself
        (engine,) = started.clients
        return engine
    try:
        transport = make_transport(exp.rollout, cfg.name, engine_root(exp, cfg.name) / "synced", started.model_dir,
                                   ranks=agent if uses_ray_workers(cfg) else None)
        return EnginePool(started.clients, transport, colocate=exp.rollout.colocate, name=cfg.name)
    except BaseException:
        for client in started.clients:
            client.close()
        raise


def build_runtime(exp: ExperimentConfig, index: int, total_updates: int,
                  agent_cfg: AgentConfig | None = None) -> AgentRuntime:
    """Agent ``index`` of ``exp`` (or ``agent_cfg`` in its place, e.g. with the warm-up learning rate).

    The starting weights are an HF model loaded here, or, when :func:`reads_weights_itself`, the HF
    folder alone: this process then holds the agent's config and tokenizer only, the trainer reads the
    folder's safetensors and the engines load the folder (linked into their init folder, in its
    stored dtype)."""
    cfg = agent_cfg or exp.agents[index]
    tokenizer = load_tokenizer(cfg.tokenizer)
    weights: PreTrainedModel | Path
    if reads_weights_itself(exp, cfg):
        from hacrl_megatron.rollout.servers import model_hf_config

        weights = starting_weights_dir(cfg)
        hf_config = model_hf_config(weights)
        _check_vocab(cfg, hf_config.vocab_size, len(tokenizer))
    else:
        weights = load_hf_model(cfg, len(tokenizer), seed=exp.train.seed * 1000 + index)
        hf_config = weights.config
    # the weights already are the starting point (init_checkpoint or hf_path): the agent copies or reads
    # them (the HF backend trains ``weights`` itself; the engine takes its own copy or folder below)
    agent = build_agent(dataclasses.replace(cfg, init_checkpoint=None), weights, exp, total_updates, hf_config)
    try:
        engine = build_engine(exp, cfg, weights, tokenizer, agent)
    except BaseException:
        agent.close()  # a Ray agent's actors
        raise
    return AgentRuntime(index=index, cfg=cfg, tokenizer=tokenizer, trainer=agent, engine=engine, hf_config=hf_config)


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
