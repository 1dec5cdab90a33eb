"""The ``trainer`` section: the run's length and seed, its devices and processes, where metrics
and checkpoints go, resuming and validation; and :data:`LOGGER_NAMES`, the metric sinks
``trainer.logger`` chooses from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megarl.config.checks import _choice, _positive, _require

LOGGER_NAMES: tuple[str, ...] = ("console", "jsonl", "tensorboard", "wandb")
"""``trainer.logger``: the metric sinks (verl's key and names; verl's ``file`` is ``jsonl``). The
console is the rollout host's; the others are :class:`megarl.trainer.metrics.MetricsWriter`'s
(the trainer sits above config, so the list lives here)."""


@dataclass(frozen=True)
class TrainerConfig:
    """``trainer``: the run's length and seed, its devices and processes, where metrics and
    checkpoints go, resuming, and validation."""

    total_steps: int = 20
    """Number of GRPO steps (one rollout batch each)."""
    skip_nonfinite_updates: bool = False
    """A non-finite gradient norm (:mod:`megarl.algo.divergence`): false stops the run with one
    line naming the step and the likely setting | true skips that update, counts it in
    ``actor/skipped_nonfinite_updates`` and trains on from the unchanged weights."""
    seed: int = 1234
    """Seeds data order, sampling (its own stream per step) and initialisation."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl, TensorBoard events and checkpoints go (created once every start-up
    check has passed; an existing file there is refused)."""
    device: str = "auto"
    """auto | cpu | cuda. auto picks CUDA when present."""
    nnodes: int = 1
    """Machines the run spans; > 1 needs ``launcher=ray``."""
    n_gpus_per_node: int = 1
    """Ranks per node; on CPU the number of worker processes."""
    launcher: str = "local"
    """local (spawn workers on this machine) | ray."""
    logger: tuple[str, ...] = ("console", "jsonl", "tensorboard")
    """Where metrics go (verl's key), any of :data:`LOGGER_NAMES`: console (one line per step;
    ``progress`` adds a live bar) | jsonl (``<run_dir>/metrics.jsonl``, which a resume cuts back and reads its
    history from) | tensorboard (``<run_dir>/tensorboard``) | wandb (Weights & Biases: needs
    ``pip install wandb``; a resumed run continues the checkpoint's wandb run)."""
    progress: bool | str = "auto"
    """Live display of the current step's phase, its work done and the run's ETA above the
    step lines (:mod:`megarl.trainer.progress`): auto (on when ``console`` is a logger and
    stdout is a terminal) | true (also when stdout is a file: escape codes and all) | false
    (the step lines alone, as CI logs and sbatch files get them)."""
    project_name: str = "megarl"
    """wandb project (verl's key)."""
    experiment_name: str | None = None
    """wandb run name (verl's key); None = the name of ``run_dir``'s folder."""
    log_console: bool | None = None
    """Older spelling, kept for existing command lines: true / false adds / removes ``console``
    in ``logger``. None = ``logger`` decides."""
    tensorboard: bool | None = None
    """Older spelling, as ``log_console``, for ``tensorboard``."""
    save_interval: int = 0
    """Save a training checkpoint every this many steps (and at the last step); 0 = never."""
    keep_last: int = 2
    """Complete checkpoints of this run_dir kept after a save; older ones it wrote are deleted
    (never a checkpoint of another run, a damaged one, or the newest: docs/reliability.md)."""
    resume: str = "auto"
    """auto (the newest checkpoint in run_dir, if any; a damaged one is an error, never skipped)
    | never (start fresh; earlier checkpoints and metrics are renamed aside) | a checkpoint path."""
    debug: bool = False
    """Print a failed rank's full Python traceback on the console (it is always written to
    ``<run_dir>/logs/``); ``HYDRA_FULL_ERROR=1`` does the same."""
    val_interval: int = 0
    """Validate on ``data.val_files`` (else the built-in arithmetic task's held-out problems)
    every this many steps and after the last (verl's ``test_freq``); 0 = never."""
    val_before_train: bool = False
    """Validate the initial weights before step 1, logged as step 0 with the same
    ``val-core/...`` names (verl's key). verl's default is true, but verl validates only when it
    has validation data; here a run without ``data.val_files`` would be refused, so the default
    is false. A resumed run does not validate again (verl does):
    :func:`megarl.algo.validation.validates_before_training` says why."""
    rollout_data_dir: str | None = None
    """Dump every step's generations to ``<rollout_data_dir>/<step>.jsonl`` (verl's key): prompt,
    response, answer, reward, advantage and whether the step trained the sequence, one line per
    sequence (:mod:`megarl.trainer.generations`); None = no dump."""
    validation_data_dir: str | None = None
    """The same for validation samples, ``<validation_data_dir>/<step>.jsonl`` (verl's key);
    None = no dump."""
    collective_timeout_s: float = 600.0
    """Seconds a rank waits in one collective, and that a rank may go without progress, before
    the run fails naming the rank that stopped. 600 s outlasts a slow first step (a model
    loading, a long rollout on CPU) yet still ends a hang within minutes on CPU and GPU."""

    def __post_init__(self) -> None:
        _positive("trainer.total_steps", self.total_steps)
        _positive("trainer.collective_timeout_s", self.collective_timeout_s)
        self._resolve_loggers()
        _require(
            self.progress == "auto" or isinstance(self.progress, bool),
            f"trainer.progress={self.progress!r}: must be auto, true or false",
        )
        _require(
            self.progress is not True or "console" in self.logger,
            "trainer.progress=true needs console in trainer.logger (the display is the console's)",
        )
        _require(self.val_interval >= 0, f"trainer.val_interval={self.val_interval}: must be >= 0")
        _require(
            bool(self.run_dir.strip()),
            f"trainer.run_dir={self.run_dir!r}: empty; name the folder the run writes to",
        )
        _require(
            self.save_interval >= 0,
            f"trainer.save_interval={self.save_interval}: must be >= 0 (0 = never)",
        )
        _positive("trainer.keep_last", self.keep_last)
        _require(bool(self.resume), "trainer.resume: must be auto, never or a checkpoint path")
        _choice("trainer.device", self.device, ("auto", "cpu", "cuda"))
        _choice("trainer.launcher", self.launcher, ("local", "ray"))
        _positive("trainer.nnodes", self.nnodes)
        _positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        _require(
            self.launcher != "local" or self.nnodes == 1,
            f"trainer.nnodes={self.nnodes}: trainer.launcher=local runs on one machine; "
            "use trainer.launcher=ray for several nodes",
        )

    def _resolve_loggers(self) -> None:
        """Check ``logger`` and fold the older booleans into it (first mention order kept)."""
        for name in self.logger:
            _require(
                isinstance(name, str) and name in LOGGER_NAMES,
                f"trainer.logger: unknown logger {name!r}; choose from {', '.join(LOGGER_NAMES)}",
            )
        loggers = list(dict.fromkeys(self.logger))
        for key, name in (("log_console", "console"), ("tensorboard", "tensorboard")):
            flag = getattr(self, key)
            _require(
                flag is None or isinstance(flag, bool),
                f"trainer.{key}={flag!r}: expected true or false",
            )
            if flag and name not in loggers:
                loggers.append(name)
            elif flag is False and name in loggers:
                loggers.remove(name)
        object.__setattr__(self, "logger", tuple(loggers))
        _require(
            bool(self.project_name.strip()), "trainer.project_name: empty; name the wandb project"
        )
        for key in ("rollout_data_dir", "validation_data_dir"):
            folder = getattr(self, key)
            _require(
                folder is None or (isinstance(folder, str) and bool(folder.strip())),
                f"trainer.{key}={folder!r}: expected a folder, or null for no dump",
            )
        _require(
            self.experiment_name is None or bool(str(self.experiment_name).strip()),
            "trainer.experiment_name: empty; name the run, or null for run_dir's folder name",
        )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @property
    def experiment(self) -> str:
        """``experiment_name``, or the run directory's folder name when it is None."""
        if self.experiment_name is not None:
            return str(self.experiment_name)
        name = Path(self.run_dir).expanduser().resolve().name
        return name or "megarl"
