"""The ``actor`` section (the policy being trained) and its subsections: ``actor.optim`` (the
AdamW optimizer, which ``critic.optim`` reuses), ``actor.lora`` and ``actor.router_replay``.

Decides what a single actor setting may be: its parallel layout, the policy loss and its
terms, micro-batch budgets. Checks that involve another section (``actor.tp`` against the
world size, the router replay against the engine) are :class:`megarl.config.schema.RunConfig`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megarl.algo.losses import AGG_MODES, KL_PENALTY_KINDS
from megarl.algo.policy_losses import POLICY_LOSS_NAMES, get_policy_loss
from megarl.algo.router_replay import ROUTER_REPLAY_MODES
from megarl.config.checks import _choice, _optional_positive, _positive, _require
from megarl.distributed.execution import OPTIMIZER_IMPLS


@dataclass(frozen=True)
class OptimConfig:
    """``actor.optim``: the actor's AdamW optimizer and gradient clipping (the learning rate is
    ``actor.lr``)."""

    section: ClassVar[str] = "actor.optim"
    """Where the section sits in the config tree, for the error messages."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's epsilon, > 0."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this; 0 = no clipping, < 0 is refused."""
    impl: str = "auto"
    """Which optimizer: ``auto`` = ``megatron`` (Megatron-Core's, on CUDA and on the CPU alike),
    or ``torch`` (``torch.optim.AdamW`` over Megatron's main grads). Megatron's keeps fp32 main
    copies of bf16 weights and excludes biases and norms from weight decay; torch's decays
    every parameter."""
    distributed: bool = False
    """Megatron's distributed optimizer: optimizer state (and, in bf16, the fp32 main copies)
    sharded over the data-parallel ranks; needs ``impl`` auto or megatron."""
    overlap_grad_reduce: bool = False
    """CUDA only: overlap DP gradient reduce-scatter with the backward pass."""
    overlap_param_gather: bool = False
    """CUDA only, with distributed: overlap the parameter all-gather with the next forward."""

    def __post_init__(self) -> None:
        _require(
            self.weight_decay >= 0, f"{self.section}.weight_decay={self.weight_decay}: must be >= 0"
        )
        _require(
            len(self.betas) == 2
            and all(isinstance(b, int | float) and not isinstance(b, bool) for b in self.betas),
            f"{self.section}.betas={list(self.betas)!r}: must be two numbers, e.g. [0.9, 0.999]",
        )
        for index, beta in enumerate(self.betas):
            _require(
                0 <= beta < 1,
                f"{self.section}.betas={list(self.betas)}: beta{index + 1}={beta} must be in [0, 1)",
            )
        _choice(f"{self.section}.impl", self.impl, OPTIMIZER_IMPLS)
        _require(
            not (self.distributed and self.impl == "torch"),
            f"{self.section}.distributed=true needs Megatron's optimizer: {self.section}.impl="
            "torch has no distributed form (use auto or megatron)",
        )
        _positive(f"{self.section}.eps", self.eps)
        _require(
            self.grad_clip >= 0,
            f"{self.section}.grad_clip={self.grad_clip}: must be >= 0 (0 = no clipping)",
        )


@dataclass(frozen=True)
class LoraConfig:
    """``actor.lora``: LoRA adapters on the actor's linear layers; off at rank 0."""

    rank: int = 0
    """LoRA rank; 0 = full fine-tuning (no adapters)."""
    alpha: float = 16.0
    """LoRA scaling: the adapters' output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    target_modules: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    """Megatron linear layers that get adapters (exported under PEFT's HF module names)."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, f"actor.lora.rank={self.rank}: must be >= 0 (0 = no LoRA)")
        _positive("actor.lora.alpha", self.alpha)
        _require(0 <= self.dropout < 1, f"actor.lora.dropout={self.dropout}: must be in [0, 1)")
        known = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
        for name in self.target_modules:
            _choice("actor.lora.target_modules", name, known)
        _require(
            self.rank == 0 or bool(self.target_modules),
            "actor.lora.target_modules: empty; name at least one layer",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class RouterReplayConfig:
    """Mixture-of-experts router replay (:mod:`megarl.algo.router_replay`; verl's
    ``actor_rollout_ref.actor.router_replay``)."""

    mode: str = "disabled"
    """disabled | R2 (replay the trainer's own old-logprob-pass routing in the training
    forwards) | R3 (replay the engine's routing of every position in the old-logprob pass and
    the training forwards)."""

    def __post_init__(self) -> None:
        _choice("actor.router_replay.mode", self.mode, ROUTER_REPLAY_MODES)


@dataclass(frozen=True)
class ActorConfig:
    """``actor``: the policy being trained: its Megatron parallel layout, learning rate, policy
    loss and its terms, and the token budgets of its micro-batches."""

    tp: int = 1
    """Tensor parallel size (Megatron): each layer's weights are split over this many ranks."""
    pp: int = 1
    """Pipeline parallel size (Megatron): the layers are split into this many stages."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank; > 1 needs pp > 1 and trains
    with Megatron's interleaved schedule (a smaller pipeline bubble; every pass then runs a
    multiple of ``pp`` micro-batches, fillers added where needed). Dense models, packed
    sequences, no LoRA or critic."""
    ep: int = 1
    """Expert parallel size (Megatron's ``expert_model_parallel_size``): a mixture-of-experts
    model's experts are split over this many ranks of the data-parallel dimension, which it must
    divide; tokens travel to their experts and back."""
    lr: float = 1e-6
    """The actor's learning rate (constant)."""
    kl_coef: float = 0.0
    """Weight of the KL(actor || reference) loss; 0 = no reference model is built."""
    kl_estimator: str = "low_var_kl"
    """One of :data:`megarl.algo.losses.KL_PENALTY_KINDS` (see
    :func:`~megarl.algo.losses.kl_penalty`)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 = none. > 0 makes
    zero-advantage pruning approximate (``planner.allow_approx``)."""
    echo_coef: float = 0.0
    """ECHO (prime-rl's ``echo`` algorithm, its ``alpha``; prime-rl's vetted setting is 0.1): the
    weight of a cross-entropy (negative log-likelihood) term on the observation tokens (tool
    output) of agent trajectories, which the policy loss never trains: the model also learns to
    predict what its tools return. 0 (the default) = observation tokens never train, and the
    loss is bitwise what it is without this key. > 0 turns zero-advantage pruning off (a
    sequence with advantage 0 still has observation tokens to learn); see
    :func:`megarl.algo.losses.echo_loss` for its normalisation."""
    moe_aux_loss_coef: float = 0.0
    """Mixture-of-experts only: weight of the router's load-balancing loss in the gradient
    (Megatron's ``moe_aux_loss_coeff`` with ``moe_router_load_balancing_type=aux_loss``, the
    Switch-Transformer loss ``actor/moe_aux_loss`` reports; typical 1e-3 to 1e-2). 0 (the
    default) trains without it, as RL fine-tuning of a trained router usually does. > 0 turns
    zero-advantage pruning off (the loss counts every routed token); how it is normalised is
    :meth:`megarl.actor.megatron_actor.MegatronActor.router_loss_coeffs`'s docstring."""
    ppo_mini_batches: int = 1
    """Optimizer steps per rollout batch (per epoch)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    policy_loss: str = "vanilla"
    """One of :data:`megarl.algo.policy_losses.POLICY_LOSS_NAMES`: vanilla (PPO clip +
    dual-clip) | gspo (sequence ratio) | cispo (clipped IS-weight REINFORCE) | sft | dppo_tv /
    dppo_kl (divergence trust region) | prime_dppo (prime-rl's default: DPPO-TV + a
    ``(log r)^2`` penalty) | geo_mean (GMPO) | sapo (soft gate) | gpg (REINFORCE) | clip_cov /
    kl_cov (covariance-selected tokens) | m2po (PPO with a second-moment mask for stale data).
    verl's ``policy_loss.loss_mode``, flattened to one string."""
    clip_ratio_low: float = 0.2
    """The ratio (cispo: the IS weight) is clipped below at ``1 - clip_ratio_low``: in (0, 1);
    cispo also takes >= 1 (no lower bound, MiniMax-M1's setting)."""
    clip_ratio_high: float = 0.2
    """... and above at ``1 + clip_ratio_high`` (> 0; DAPO's clip-higher sets it above low;
    gspo's sequence ratio wants ranges like 3e-4 / 4e-4)."""
    clip_ratio_c: float = 3.0
    """vanilla's dual-clip for negative advantages: a token's loss is at most
    ``-A * clip_ratio_c`` (> 1; verl's default 3.0); dppo_tv / dppo_kl truncate their detached
    ratio at it."""
    tau_pos: float = 1.0
    """sapo: the gate's temperature for positive advantages, > 0 (verl's key and default)."""
    tau_neg: float = 1.05
    """sapo: the gate's temperature for other advantages, > 0 (verl: 1.05; above tau_pos, a
    negative advantage's gate closes faster)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: the fraction of the batch's trained tokens it detaches, in (0, 1] (verl's
    ``policy_loss.clip_cov_ratio``)."""
    clip_cov_lb: float = 1.0
    """clip_cov: a detached token's centred covariance of log-prob and advantage lies above
    this ..."""
    clip_cov_ub: float = 5.0
    """... and below this (> clip_cov_lb)."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: the fraction of the batch's trained tokens (those of largest covariance) that get
    the ``ppo_kl_coef * |log r|`` penalty, in (0, 1]."""
    ppo_kl_coef: float = 0.1
    """kl_cov: the penalty's weight, >= 0 (verl's ``policy_loss.ppo_kl_coef``)."""
    kl_tau: float = 1e-3
    """prime_dppo: the weight of its ``(log r)^2`` penalty on every token, >= 0 (prime-rl's
    ``loss.kl_tau``). > 0 acts on zero-advantage tokens, so pruning them is not exact."""
    adv_tau: float = 1.0
    """prime_dppo: the scale of its advantage term, >= 0 (prime-rl's ``loss.adv_tau``)."""
    m2_threshold: float = 0.04
    """m2po: the bound on the batch's second moment ``mean (log pi_prox - log pi_behav)^2``
    of the tokens' staleness (AReaL's key), > 0; the tokens of largest value are masked until
    the rest is below it."""
    loss_agg: str | None = None
    """One of :data:`megarl.algo.losses.AGG_MODES` (see :func:`~megarl.algo.losses.aggregate`);
    None (the default) = the policy loss's own: seq-mean-token-mean for gspo, as verl forces it,
    token-mean otherwise. Resolved at construction, so it is never None afterwards."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm's constant divisor; None = ``rollout.max_new_tokens``."""
    micro_batch_tokens: int = 4096
    """Token budget of one training micro-batch (sequences are packed up to it)."""
    logprob_micro_batch_tokens: int = 8192
    """Token budget of one forward-only (logprob) micro-batch."""
    logprob_chunk_tokens: int = 4096
    """Tokens per chunk when turning vocab-parallel logits into logprobs and entropy."""
    recompute: str = "none"
    """none | selective (attention core) | full (whole layers): activation recomputation."""
    # --- sequence packing ---
    pack_sequences: bool = True
    """Pack each micro-batch into one row (no pad tokens; attention and RoPE per sequence):
    SDPA per sequence block on CPU, transformer-engine THD on GPU. false = right-padded rows."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)

    def __post_init__(self) -> None:
        _positive("actor.tp", self.tp)
        _positive("actor.pp", self.pp)
        _positive("actor.lr", self.lr)
        _choice("actor.policy_loss", self.policy_loss, POLICY_LOSS_NAMES)
        if self.policy_loss == "cispo":
            _positive("actor.clip_ratio_low", self.clip_ratio_low)
        else:
            _require(
                0 < self.clip_ratio_low < 1,
                f"actor.clip_ratio_low={self.clip_ratio_low}: must be in (0, 1) "
                "(the ratio is clipped below at 1 - clip_ratio_low)",
            )
        _positive("actor.clip_ratio_high", self.clip_ratio_high)
        _require(
            self.clip_ratio_c > 1,
            f"actor.clip_ratio_c={self.clip_ratio_c}: must be > 1 "
            "(the dual-clip bound lies above the clipped ratio)",
        )
        self._check_loss_keys()
        _optional_positive("actor.loss_scale_factor", self.loss_scale_factor)
        _require(self.kl_coef >= 0, f"actor.kl_coef={self.kl_coef}: must be >= 0")
        _require(self.entropy_coef >= 0, f"actor.entropy_coef={self.entropy_coef}: must be >= 0")
        _require(self.echo_coef >= 0, f"actor.echo_coef={self.echo_coef}: must be >= 0 (0 = off)")
        _require(
            0 <= self.moe_aux_loss_coef < float("inf"),
            f"actor.moe_aux_loss_coef={self.moe_aux_loss_coef}: must be a finite number >= 0 "
            "(0 = off)",
        )
        _choice("actor.kl_estimator", self.kl_estimator, KL_PENALTY_KINDS)
        if self.loss_agg is None:
            object.__setattr__(self, "loss_agg", get_policy_loss(self.policy_loss).default_agg)
        _choice("actor.loss_agg", str(self.loss_agg), AGG_MODES)
        _positive("actor.ppo_mini_batches", self.ppo_mini_batches)
        _positive("actor.ppo_epochs", self.ppo_epochs)
        _positive("actor.micro_batch_tokens", self.micro_batch_tokens)
        _positive("actor.logprob_micro_batch_tokens", self.logprob_micro_batch_tokens)
        _positive("actor.logprob_chunk_tokens", self.logprob_chunk_tokens)
        _positive("actor.vpp", self.vpp)
        _positive("actor.ep", self.ep)
        _require(
            self.vpp == 1 or self.pp > 1,
            f"actor.vpp={self.vpp}: virtual pipeline stages need actor.pp > 1",
        )
        _choice("actor.recompute", self.recompute, ("none", "selective", "full"))

    def _check_loss_keys(self) -> None:
        """The 2026 losses' own keys (each read by one loss, checked whatever the loss)."""
        _positive("actor.tau_pos", self.tau_pos)
        _positive("actor.tau_neg", self.tau_neg)
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, key)
            _require(0 < value <= 1, f"actor.{key}={value}: must be in (0, 1] (a token fraction)")
        _require(
            self.clip_cov_lb < self.clip_cov_ub,
            f"actor.clip_cov_lb={self.clip_cov_lb}: must be below actor.clip_cov_ub="
            f"{self.clip_cov_ub}",
        )
        _positive("actor.m2_threshold", self.m2_threshold)
        for key in ("ppo_kl_coef", "kl_tau", "adv_tau"):
            value = getattr(self, key)
            _require(
                0 <= value < float("inf"), f"actor.{key}={value}: must be a finite number >= 0"
            )

    @property
    def loss_keys(self) -> dict[str, float]:
        """The loss-specific keys, as :class:`megarl.algo.policy_losses.ClipSettings` names
        them (``policy_loss``'s ``loss_keys``)."""
        names = ("tau_pos", "tau_neg", "ppo_kl_coef", "kl_tau", "adv_tau")
        return {name: float(getattr(self, name)) for name in names}

    @property
    def micro_batch_multiple(self) -> int:
        """Every pass's micro-batch count per rank is a multiple of this: ``pp`` under the
        interleaved schedule, which runs micro-batches in groups of one per pipeline stage."""
        return self.pp if self.vpp > 1 else 1
