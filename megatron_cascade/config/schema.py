"""Schema of a cascade run: run-level defaults, domains, and the list of stages.

Every default lives in these dataclasses (and model.py / training.py) and nowhere else. A stage's
``optimizer``/``loss``/``training``/``rollout`` sections are partial overrides of the run-level
sections of the same name, merged (and type-checked) by ``config.loader``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from megatron_cascade.config.model import DecodeParallelConfig, ModelConfig, ParallelConfig
from megatron_cascade.config.rules import MAX_TIMEOUT_S, Choice, checked, ranged, require
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.config.stage_types import STAGE_TYPES as _REGISTERED_STAGE_TYPES
from megatron_cascade.config.template_args import chat_template_kwargs_problem

STAGE_TYPES = tuple(_REGISTERED_STAGE_TYPES)  # the stage-type registry (megatron_cascade/stages)


class OverlongPolicy(Choice):
    zero = "zero"  # an unfinished response gets reward 0
    mask = "mask"  # an unfinished response is left out of the loss


class AdvantageBaseline(Choice):
    mean = "mean"
    leave_one_out = "leave_one_out"


class AdvantageStd(Choice):
    sample = "sample"  # n - 1: verl, NeMo-RL, TRL
    population = "population"  # n


class OnBadRow(Choice):
    skip = "skip"  # report file:line and go on
    error = "error"  # stop at the first bad row


@dataclass
class RolloutConfig:
    """Sampling for training rollouts (evaluation uses ``eval``)."""

    # The trainer's log-probs are of softmax(logits / temperature): > 0 (greedy decoding is eval-only).
    temperature: float = ranged(1.0, gt=0, why="the trainer divides the logits by it; greedy is eval.temperature: 0")
    top_p: float = ranged(1.0, gt=0, le=1)  # 1 = off
    top_k: int = ranged(0, ge=0)  # 0 = off
    max_new_tokens: int = ranged(64, ge=1)  # < model.max_position_embeddings
    stop_strings: List[str] = checked(all, "must not contain an empty string (it would end every response at once)",
                                      default_factory=list)
    overlong_policy: OverlongPolicy = OverlongPolicy.zero  # unfinished responses: zero (reward 0) | mask (no loss)
    filter_uninformative_groups: bool = True  # drop groups whose rewards are all equal
    # Dynamic sampling (DAPO, NeMo-RL): after filtering, generate groups for further prompts until
    # prompts_per_step informative groups are collected, in at most this many generation rounds per step
    # (1 = off: the step trains on whatever survived the filter). Needs filter_uninformative_groups.
    dynamic_sampling_max_rounds: int = ranged(1, ge=1)
    std_normalize_advantages: bool = True
    advantage_baseline: AdvantageBaseline = AdvantageBaseline.mean  # mean | leave_one_out
    advantage_std: AdvantageStd = AdvantageStd.sample  # sample (n - 1: verl, NeMo-RL, TRL) | population (n)
    # Paged KV cache of generation, per rank: a byte budget, or (null) kv_cache_fraction of the free
    # device memory (on CPU: available RAM) when generation starts. Requests that do not fit wait.
    kv_cache_bytes: Optional[int] = ranged(None, gt=0, why="or null: rollout.kv_cache_fraction of the free memory")
    kv_cache_fraction: float = ranged(0.5, gt=0, le=1)
    kv_block_size_tokens: int = ranged(256, ge=1)  # flash-attn 2 paged kernels (GPU) need a multiple of 256
    # Expected response length / max_new_tokens: sizes a hybrid model's Mamba state slots in generation
    # and the dry run's samples decoding at once (KV is taken on demand, so the mean length, not the cap).
    expected_response_fraction: float = ranged(0.5, gt=0, le=1)
    # Single-turn stages: from the second step on, generation expects the previous step's mean response
    # length (response/length_mean / max_new_tokens) instead (RL responses lengthen as training goes: a
    # fixed guess admits too few requests early and preempts later). Tokens do not change either way.
    adapt_expected_response_fraction: bool = True
    # Decode steps padded to this many batch sizes (Megatron's num_cuda_graphs); on a GPU the decode copy
    # (rollout.parallel) replays a CUDA graph per size. null: eager decode steps.
    cuda_graphs: Optional[int] = ranged(None, ge=1, le=256, why="or null: eager decode steps")
    # A decode layout: generation on an inference-only copy of the policy at this layout (TP, PP, EP,
    # ETP; no CP), refit in memory after every optimizer step. null: generate at the training layout.
    parallel: Optional[DecodeParallelConfig] = None
    # While generating, the policy's gradients and optimizer state (and its weights, when a decode copy
    # generates) wait in host memory and come back bit for bit for training: the KV cache gets their
    # room (fp32 grads are 2x, Adam's state up to 6x the bf16 weights) for one host round trip per step.
    # The dry run counts it.
    offload_training_state: bool = True

    def validate(self, prefix: str = "rollout.") -> None:
        """Rules between the rollout fields (``ConfigError`` naming the keys)."""
        require(self.dynamic_sampling_max_rounds == 1 or self.filter_uninformative_groups,
                f"{prefix}dynamic_sampling_max_rounds > 1 replaces filtered groups: it needs "
                f"{prefix}filter_uninformative_groups: true")
        require(self.cuda_graphs is None or self.parallel is not None,
                f"{prefix}cuda_graphs needs {prefix}parallel: graphs are captured on the decode copy "
                "(the training model runs training forwards, which must not replay inference graphs)")


class ReasoningParserName(Choice):
    none = "none"  # the reward sees the whole response
    think = "think"  # the reward sees only what follows the reasoning (reasoning_markers)


def _two_markers(markers: Any) -> bool:
    return (len(markers) == 2 and all(isinstance(m, str) and m for m in markers)
            and markers[0] != markers[1])


@dataclass
class RewardSpec:
    """A reward from the registry (or a dotted path ``pkg.module:function``) and its keyword args."""

    name: str = checked(bool, "must name a reward (registry name or pkg.module:function)", default="math")
    kwargs: Dict[str, Any] = field(default_factory=dict)
    timeout_s: float = ranged(30.0, gt=0, le=MAX_TIMEOUT_S)  # a call running longer scores 0 and is counted as an error
    # think: the reward scores only the answer after the reasoning; reasoning that never closed scores 0
    # (counted as unfinished, not as a reward error). megatron_cascade/rewards/reasoning.py
    reasoning_parser: ReasoningParserName = ReasoningParserName.none
    reasoning_markers: List[str] = checked(_two_markers, "must be [start, end]: two different non-empty strings",
                                           default_factory=lambda: ["<think>", "</think>"])


@dataclass
class EnvironmentSpec:
    """The environment episodes of a domain run in (megatron_cascade/environments): single_turn (one
    response, today's rollouts) or a multi-turn one (tool calling, SWE) with its turn and token budgets."""

    name: str = checked(bool, "must name an environment (single_turn | tool_calling | pkg.module:Class)",
                        default="single_turn")
    kwargs: Dict[str, Any] = field(default_factory=dict)
    max_turns: int = ranged(8, ge=1)  # model turns per episode (single_turn: always 1)
    # Tokens after the prompt (model turns and observations together); null = max_turns x rollout.max_new_tokens.
    # Each turn samples at most rollout.max_new_tokens; the model's max_position_embeddings bounds it too.
    max_episode_tokens: Optional[int] = ranged(None, ge=1, why="or null: max_turns x rollout.max_new_tokens")
    # An environment step (a tool call, a test run) running longer ends its episode with score 0.
    step_timeout_s: float = ranged(30.0, gt=0, le=MAX_TIMEOUT_S)


@dataclass
class RewardsConfig:
    """Run-level handling of reward failures (per-domain rewards live under ``domains.*.reward``)."""

    # A sample whose reward raised, returned a non-number or timed out is invalid (left out of the loss,
    # the normaliser and its group's advantage statistics). A step in which more than this fraction of
    # all samples (every data-parallel rank) is invalid stops the run before the optimizer step:
    # a reward server outage must not train the policy on zeros.
    max_error_frac: float = ranged(0.5, ge=0, le=1, why="1 never stops the run")


@dataclass
class DomainConfig:
    """One data domain: JSONL files and the reward that scores it."""

    train: Optional[str] = None  # JSONL prompts for RL stages (path relative to the config file's folder)
    eval: Optional[str] = None  # held-out JSONL, scored after every stage
    sft: Optional[str] = None  # JSONL with reference responses for sft stages; null = train
    reward: RewardSpec = field(default_factory=RewardSpec)
    environment: EnvironmentSpec = field(default_factory=EnvironmentSpec)  # default single_turn


@dataclass
class DataConfig:
    on_bad_row: OnBadRow = OnBadRow.skip  # skip (report file:line and go on) | error (stop at the first bad row)
    max_prompt_tokens: int = ranged(512, ge=1)  # longer prompts are bad rows


@dataclass
class EvalConfig:
    """Held-out evaluation after every stage (stage x domain table in the manifest)."""

    enabled: bool = True
    max_prompts: int = ranged(64, ge=1)  # per domain
    # Also score the stage's own domains every this many steps during a stage that generates (RL, MOPD;
    # not SFT) (metrics.jsonl: eval/<domain>, eval_se/<domain>); 0 = only after each stage.
    every_steps: int = ranged(0, ge=0)
    max_new_tokens: Optional[int] = ranged(None, ge=1)  # null = rollout.max_new_tokens
    temperature: float = ranged(0.0, ge=0)  # 0 = greedy pass@1
    samples: int = ranged(1, ge=1)  # per prompt (pass@1 is their mean)

    def validate(self, prefix: str = "eval.") -> None:
        """Rules between the eval fields (``ConfigError`` naming the keys)."""
        require(self.samples == 1 or self.temperature > 0,
                f"{prefix}samples={self.samples} with {prefix}temperature=0 scores the same greedy answer "
                f"{self.samples} times: set {prefix}samples: 1 or a temperature > 0")


@dataclass
class CheckpointConfig:
    every_steps: int = ranged(10, ge=0)  # 0 = only at the end of a stage (and on a preemption signal)
    keep_last: int = ranged(2, ge=0)  # training checkpoints kept per stage; 0 = all
    # Under Slurm, seconds kept free before the job's end time for the final checkpoint and exit: a
    # step that (at the longest recent step time) would end inside this margin is not started; the run
    # checkpoints and exits 75 (requeue) instead. Size it to a checkpoint write plus shutdown.
    time_limit_margin_s: float = ranged(600.0, ge=0)


@dataclass
class DistributedConfig:
    """Process-group settings of a real (multi-process) run."""

    # Collective timeout of the process group and of every Megatron group: a rank that waits longer
    # than this in one collective fails the job (far past torch's 10/30-minute defaults: checkpoint
    # writes, teacher swaps, evaluation). Waits for a slower replica's generation happen outside
    # collectives (generation_wait_minutes).
    timeout_minutes: float = ranged(120.0, gt=0)
    # After generating (and scoring) a round, ranks wait for the slowest outside every collective
    # (rollout/meeting.py), so the timeout above never has to cover a long generation; a rank still
    # generating after this long fails the job, named.
    generation_wait_minutes: float = ranged(1440.0, gt=0, le=MAX_TIMEOUT_S / 60)


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass
class ClusterConfig:
    """The machine a dry run plans for (a real run uses the processes it was launched with)."""

    nodes: int = ranged(1, ge=1)
    gpus_per_node: int = ranged(8, ge=1)
    gpu_memory_gib: float = ranged(80.0, gt=0)
    # Whether the cluster's Python has Transformer Engine (pip install .[gpu]). The dry run then plans
    # the TE layer spec (fused attention keeps no [s x s] scores; FP8 allowed); false: the local spec,
    # whose attention materialises the scores, and FP8 refused.
    transformer_engine: bool = True
    # Memory per GPU that no tensor of the model holds: CUDA context, NCCL buffers, cuBLAS / TE
    # workspaces, allocator fragmentation (typically 3-6 GiB). Counted in every stage's peak and left
    # out of the KV budget that kv_cache_fraction takes from the free memory.
    runtime_overhead_gib: float = ranged(5.0, ge=0)
    # MoE with expert parallelism: routed tokens on the most loaded EP rank over the mean (a router
    # balances its load over a step, not over every micro-batch). Scales the routed experts'
    # activations and generation intermediates in the plan (capped at EP: all tokens on one rank).
    moe_load_imbalance: float = ranged(1.5, ge=1.0)


@dataclass
class StageConfig:
    """One stage of the cascade. Sections left null inherit the run-level ones."""

    name: str = "???"
    type: str = "grpo"  # a registered stage type: sft | grpo | mopd | distill
    steps: int = ranged(10, ge=1)
    prompts_per_step: int = ranged(16, ge=1)  # global, over all data-parallel ranks
    samples_per_prompt: int = ranged(4, ge=1)  # G (sft: ignored; grpo: >= 2, a group of one has no signal)
    domains: Dict[str, float] = field(default_factory=dict)  # domain -> sampling weight
    teachers: Dict[str, str] = field(default_factory=dict)  # mopd: domain -> stage name or weights dir
    # The earlier stage whose final weights this stage starts from; null = the previous stage (the cascade).
    init_from: Optional[str] = None
    optimizer: Optional[Dict[str, Any]] = None
    loss: Optional[Dict[str, Any]] = None
    training: Optional[Dict[str, Any]] = None
    rollout: Optional[Dict[str, Any]] = None

    def validate(self, prefix: str) -> None:
        """Rules between the stage's own fields (names and teachers are checked against the run)."""
        for domain, weight in self.domains.items():
            require(math.isfinite(weight) and weight > 0,
                    f"{prefix}domains.{domain}={weight} must be > 0 (a sampling weight)")
        # GRPO advantages compare the responses of a group: a group of one is all zeros.
        groups = self.type in _REGISTERED_STAGE_TYPES and _REGISTERED_STAGE_TYPES[self.type].groups
        require(not groups or self.samples_per_prompt >= 2,
                f"{prefix}samples_per_prompt={self.samples_per_prompt}: a {self.type} stage needs >= 2 responses "
                "per prompt (a group of one has advantage 0 and trains nothing)")


def _json_like(value: Any) -> bool:
    """``value`` is JSON data: null, bool, number, string, or lists and string-keyed dicts of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return not isinstance(value, float) or math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_json_like(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    return False


def _template_variables(kwargs: Dict[str, Any]) -> bool:
    """Keys are Jinja variable names (identifiers) and values JSON data."""
    return all(isinstance(k, str) and k.isidentifier() for k in kwargs) and _json_like(dict(kwargs))


@dataclass
class RunConfig:
    """A whole cascade run."""

    output_dir: str = checked(bool, "must name a folder", default="???")
    # The stage RNGs and the data mixer derive their seeds from it (seed * 1_000_003 + step must fit in 64 bits).
    seed: int = ranged(1234, ge=0, lt=2**32)
    # builtin:char | a local Hugging Face tokenizer folder
    tokenizer: str = checked(bool, "must name a tokenizer", default="builtin:char")
    # Extra variables of the Hugging Face chat template, passed to every rendering (prompts and tool
    # turns): e.g. {enable_thinking: false} turns reasoning off in Qwen3 and Nemotron-3-Nano templates.
    chat_template_kwargs: Dict[str, Any] = checked(
        _template_variables, "must map variable names (identifiers) to JSON values (null, bool, number, string, "
        "lists and mappings of them)", default_factory=dict)
    init_checkpoint: Optional[str] = None  # weights dir (or converted HF) to start from; null = random
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    domains: Dict[str, DomainConfig] = field(default_factory=dict)
    stages: List[StageConfig] = field(default_factory=list)

    def validate(self, prefix: str = "") -> None:
        """Rules between run-level fields (``ConfigError`` naming the keys)."""
        problem = chat_template_kwargs_problem(self.tokenizer, self.chat_template_kwargs)
        require(problem is None, f"{prefix}{problem}")


@dataclass
class ResolvedStage:
    """A stage with every section merged over the run-level defaults (what the runner uses)."""

    name: str
    type: str
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    domains: Dict[str, float]
    teachers: Dict[str, str]
    optimizer: OptimizerConfig
    loss: LossConfig
    training: TrainingConfig
    rollout: RolloutConfig
    init_from: Optional[str] = None  # the stage whose final weights it starts from (null: the previous one)
