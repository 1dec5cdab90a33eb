"""``megarl-train``: compose the Hydra config, validate it, resolve the model, launch the ranks.

Every start-up error (unknown key, bad value, TP/PP that cannot split the model, a missing model
or dataset) is one line on stderr naming the key or file, and exit code 2, before any worker
process starts or anything is written.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from megarl.errors import StartupError  # callers catch it from here too
from megarl.trainer.model_dirs import (
    TEACHER_FOLDER,
    check_teacher,
    distill_problem,
    place_model_dir,
    resolve_model_dir,
    resolve_teacher_dir,
)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
EXIT_BAD_INPUT = 2


def compose_config(overrides: list[str], config_dir: Path | None = None):
    """Compose ``configs/config.yaml`` with Hydra command-line overrides into a RunConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megarl.config.schema import ConfigError, build_run_config

    folder = config_dir or Path(os.environ.get("MEGARL_CONFIG_DIR", CONFIG_DIR))
    _check_group_choices(overrides, folder)
    try:
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        # the composed root is a DictConfig, so its container is a dict with string keys
        tree = cast("dict[str, Any]", OmegaConf.to_container(cfg, resolve=True))
    except (HydraException, OmegaConfBaseException) as exc:
        raise StartupError(_one_line(exc)) from None
    try:
        return build_run_config(tree)
    except ConfigError as exc:
        raise StartupError(str(exc)) from None


CONFIG_GROUPS = ("model", "recipe")
"""Folders of ``configs/`` chosen by name on the command line (``model=tiny_llama``)."""


def _check_group_choices(overrides: list[str], folder: Path) -> None:
    """``recipe=nope`` names the choices there are, instead of Hydra's "Could not find"."""
    for override in overrides:
        group, sep, choice = override.lstrip("+").partition("=")
        if not sep or group not in CONFIG_GROUPS or choice in ("", "null"):
            continue
        available = sorted(p.stem for p in (folder / group).glob("*.yaml"))
        if choice not in available:
            raise StartupError(
                f"{group}={choice}: no such {group} in {folder / group}; "
                f"available: {', '.join(available)}"
            )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first.replace("Could not override", "unknown config key or bad override:")


def resolve_device(requested: str, cfg=None) -> str:
    """auto -> cuda when present; with ``cfg``, also checks the execution plan can be made."""
    from megarl.distributed.execution import (
        ExecutionError,
        ExecutionRequest,
        decide_execution,
        detect_environment,
    )
    from megarl.distributed.execution import resolve_device as _resolve

    env = detect_environment()
    try:
        if cfg is not None:
            plan = decide_execution(ExecutionRequest.from_config(cfg), env)
            return plan.device
        return _resolve(requested, env)
    except ExecutionError as exc:
        raise StartupError(str(exc)) from None


def validate_against_model(cfg, model_dir: str, device: str = "cpu") -> None:
    """Checks that need the model's shape or the data: parallel layout, gates, planner, dataset."""
    from megarl.algo.router_replay import dense_model_problem
    from megarl.config.planning import loss_terms, prune_mode, run_facts
    from megarl.data.errors import DatasetError
    from megarl.data.rewards import choose_rewards
    from megarl.models.hf_io import load_hf_config
    from megarl.models.spec import ModelSpecError, spec_from_hf_config, vpp_training_problem
    from megarl.planner.gates import GateConfigError, validate_gate_config
    from megarl.planner.inputs import PlannerError
    from megarl.planner.pruning import check_pruning_config
    from megarl.trainer.rollout_host import training_source, validation_problems

    try:
        spec = spec_from_hf_config(load_hf_config(model_dir))
        replay_mode = cfg.actor.router_replay.mode
        spec.check_parallelism(cfg.actor.tp, cfg.actor.pp, cfg.actor.vpp, cfg.actor.ep)
        if spec.is_moe and cfg.algo.uses_critic:
            raise StartupError(
                f"algo.adv_estimator={cfg.algo.adv_estimator}: a critic for a mixture-of-experts "
                f"model ({spec.family}) is not supported yet; use a critic-free estimator "
                "(grpo, rloo, reinforce_plus_plus)"
            )
        if not spec.is_moe and cfg.actor.moe_aux_loss_coef > 0:
            raise StartupError(
                f"actor.moe_aux_loss_coef={cfg.actor.moe_aux_loss_coef}: the model "
                f"({spec.family}) is dense and has no router to balance; set it to 0"
            )
        if not spec.is_moe and (problem := dense_model_problem(replay_mode, spec.family)):
            raise StartupError(problem)
        if spec.is_moe and cfg.actor.lora.enabled:
            raise StartupError(
                f"actor.lora.rank={cfg.actor.lora.rank}: LoRA on a mixture-of-experts model "
                f"({spec.family}) is not supported; set actor.lora.rank=0"
            )
        if cfg.algo.uses_critic and cfg.critic.model.path is not None:
            from megarl.critic.hf_init import check_critic_folder

            check_critic_folder(cfg.critic.model.path, spec, cfg.critic.value_head_init_std)
        if cfg.actor.vpp > 1 and (
            problem := vpp_training_problem(
                spec.is_moe, cfg.actor.lora.enabled, cfg.algo.uses_critic, cfg.actor.pack_sequences
            )
        ):
            raise StartupError(problem)
        if cfg.rollout.engine == "vllm" and not cfg.algo.is_sft:
            check_vllm(cfg, model_dir, device)
        if cfg.rollout.engine_is_actor and spec.is_moe and cfg.actor.tp > 1:
            raise StartupError(
                f"rollout.engine=megatron with actor.tp={cfg.actor.tp}: a mixture-of-experts "
                f"model ({spec.family}) runs sequence-parallel under TP, which splits each "
                "sequence over the TP ranks and cannot split one decoded token; use actor.tp=1 "
                "(with actor.ep for the experts) or rollout.engine=hf"
            )
        validate_gate_config(run_facts(cfg))
        check_pruning_config(prune_mode(cfg)[0], loss_terms(cfg), cfg.planner.allow_approx)
        if cfg.algo.is_sft:
            check_sft_data(cfg, model_dir, spec.max_position_embeddings)
            return
        if cfg.data.reward_components is not None:  # each function imports, or the start stops
            choose_rewards(cfg.data.reward_components, cfg.data.task)
        source, dropped = training_source(cfg, model_dir, spec.max_position_embeddings)
        if dropped and isinstance(source, list):
            if not source:
                raise StartupError(
                    f"data.filter_overlong_prompts: all {dropped} prompts are over the prompt "
                    "budget; raise data.max_prompt_length or lower rollout.max_new_tokens"
                )
            print(
                f"data: data.filter_overlong_prompts left out {dropped} of "
                f"{dropped + len(source)} prompts that do not fit",
                flush=True,
            )
        check_context_fit(cfg, model_dir, source, spec.max_position_embeddings)
        if cfg.data.val_files:
            val = validation_problems(cfg)
            check_context_fit(cfg, model_dir, val, spec.max_position_embeddings)
    except (ModelSpecError, GateConfigError, PlannerError, DatasetError, ValueError) as exc:
        raise StartupError(str(exc).splitlines()[0]) from None


def check_sft_data(cfg, model_dir: str, context: int) -> None:
    """``algo.objective=sft``: every training and validation conversation renders, has an
    assistant turn and fits; a bad row stops the start naming ``file:row``, or with
    ``data.skip_bad_rows`` the rows left out are counted here."""
    from megarl.models.hf_io import load_hf_tokenizer
    from megarl.sft.conversations import BadRow
    from megarl.trainer.sft_batches import load_sft_examples

    tokenizer = load_hf_tokenizer(model_dir)
    for key, files in (
        ("data.train_files", cfg.data.train_files),
        ("data.val_files", cfg.data.val_files),
    ):
        if not files:
            continue
        try:
            examples, skipped = load_sft_examples(cfg, tokenizer, files, context)
        except BadRow as exc:
            raise StartupError(str(exc)) from None
        if skipped:
            print(
                f"data: data.skip_bad_rows left out {len(skipped)} of "
                f"{len(skipped) + len(examples)} rows of {key} (the first: {skipped[0]})",
                flush=True,
            )
        if not examples:
            raise StartupError(f"{key}: no row to train on ({len(skipped)} bad rows left out)")


CONTEXT_CHECK_MAX_PROMPTS = 4096
"""The built-in arithmetic stream is endless: start-up checks the prompts the run will draw, at
most this many (a JSONL dataset is checked whole)."""


def check_context_fit(cfg, model_dir: str, source, max_position_embeddings: int) -> None:
    """Every prompt, templated and tokenized as the rollout will, + ``rollout.max_new_tokens``
    fits the context (:mod:`megarl.config.context`); raises ``ConfigError`` (a ValueError)."""
    from megarl.config.context import check_prompts_fit, context_limit
    from megarl.data.arithmetic import ArithmeticTask
    from megarl.errors import BadInputError
    from megarl.models.hf_io import load_hf_tokenizer
    from megarl.trainer.agent_rollout import AgentRollout
    from megarl.trainer.rollout import rollout_prompt_ids

    if isinstance(source, ArithmeticTask):
        drawn = cfg.data.prompts_per_step * cfg.trainer.total_steps
        problems = source.problems(0, min(drawn, CONTEXT_CHECK_MAX_PROMPTS))
    else:
        problems = list(source)
    tokenizer = load_hf_tokenizer(model_dir)
    system_prompt = cfg.data.system_prompt
    try:  # the agent loops and their tools are built here first: a bad one stops the start
        agents = AgentRollout(cfg.rollout.agent, tokenizer, system_prompt)
    except BadInputError as exc:
        raise StartupError(str(exc).splitlines()[0]) from None
    lens = []
    for problem in problems:
        try:
            lens.append(len(rollout_prompt_ids(tokenizer, problem, system_prompt, agents)))
        except BadInputError as exc:  # a row's agent_name that names no loop
            raise StartupError(f"{problem.source}: {str(exc).splitlines()[0]}") from None
    limit = context_limit(max_position_embeddings, cfg.rollout.engine, cfg.rollout.max_model_len)
    check_prompts_fit(lens, cfg.rollout.max_new_tokens, limit, cfg.data.max_prompt_length)


def check_vllm(cfg, model_dir: str, device: str) -> None:
    """``rollout.engine=vllm``: installed, able to serve this model with these settings.

    Settings it changes on the user's behalf (e.g. a sleep level the CPU build cannot do) are
    printed as warnings; see :mod:`megarl.engines.vllm_settings`.
    """
    import json

    from megarl.engines.vllm_settings import VLLMSettingsError
    from megarl.trainer.engine_setup import vllm_settings

    check_engine_installed("vllm")
    if cfg.export.checksum_interval and cfg.rollout.tp > 1:
        raise StartupError(
            f"export.checksum_interval={cfg.export.checksum_interval} needs "
            f"rollout.tp=1 with vLLM (got {cfg.rollout.tp}); set it to 0"
        )
    try:
        settings = vllm_settings(cfg, model_dir, device)
    except VLLMSettingsError as exc:
        raise StartupError(str(exc)) from None
    architectures = (
        json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    )
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    if architectures and not any(arch in supported for arch in architectures):
        raise StartupError(
            f"rollout.engine=vllm: vLLM cannot serve {', '.join(architectures)} "
            f"({model_dir}); use rollout.engine=hf"
        )
    for note in settings.notes:
        print(f"megarl-train: warning: {note}", file=sys.stderr)


def check_run_dir(run_dir: str) -> None:
    """``trainer.run_dir`` can become the run's folder: not a file, under no file, writable.

    Checked before anything else touches the disk; nothing is created here (the folder is made
    only once every start-up check has passed).
    """
    check_creatable_folder("trainer.run_dir", run_dir)


def check_creatable_folder(key: str, folder: str | Path) -> None:
    """``folder`` (the value of ``key``) is a folder or can be made one: not a file, under no
    file, its nearest existing ancestor writable. Creates nothing."""
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise StartupError(f"{key}={folder}: exists and is not a folder")
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise StartupError(f"{key}={folder}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StartupError(f"{key}={folder}: {existing} is not writable")


def check_engine_installed(engine: str) -> None:
    """The rollout engine's library is importable: checked before any model is read or written."""
    import importlib.util

    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        from megarl.engines.vllm import VLLM_MISSING_MESSAGE

        raise StartupError(VLLM_MISSING_MESSAGE)


def check_loggers_installed(loggers: tuple[str, ...]) -> None:
    """``trainer.logger``'s optional libraries are importable (wandb), checked at start-up."""
    import importlib.util

    if "wandb" in loggers and importlib.util.find_spec("wandb") is None:
        from megarl.trainer.metrics import WANDB_MISSING_MESSAGE

        raise StartupError(WANDB_MISSING_MESSAGE)


def check_dump_dirs(cfg) -> None:
    """``trainer.rollout_data_dir`` / ``validation_data_dir`` hold no step file this run is going
    to write (another run's, or steps an interrupted run dumped past the checkpoint a resume
    continues from): refused in one line, since a dump never overwrites a file."""
    from megarl.algo.validation import validates_before_training
    from megarl.checkpoint.layout import CheckpointError
    from megarl.checkpoint.resume import find_resume_checkpoint
    from megarl.trainer.generations import conflicting_step_files

    t = cfg.trainer
    folders = [
        ("rollout_data_dir", t.rollout_data_dir),
        ("validation_data_dir", t.validation_data_dir),
    ]
    folders = [(key, Path(folder).expanduser()) for key, folder in folders if folder is not None]
    if not folders:
        return
    for key, folder in folders:
        check_creatable_folder(f"trainer.{key}", folder)
    try:
        info = find_resume_checkpoint(t.resume, t.run_dir)
    except CheckpointError as exc:
        raise StartupError(str(exc)) from None
    start = info.step if info is not None else 0
    for key, folder in folders:
        step_zero = key == "validation_data_dir" and validates_before_training(
            t.val_before_train, start
        )
        taken = conflicting_step_files(folder, start + 1, step_zero)
        if taken:
            shown = ", ".join(taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
            raise StartupError(
                f"trainer.{key}={folder}: {shown} already exist (this run writes steps "
                f"{start + 1} onwards and never overwrites a file); move them or choose another "
                "folder"
            )


def resolve_resume(cfg, model_dir: str) -> str | None:
    """The checkpoint this run continues from (``trainer.resume``), checked against the config,
    the model's tokenizer and the dataset; see :func:`megarl.checkpoint.resume.prepare_resume`."""
    import dataclasses

    from megarl.checkpoint.layout import CheckpointError
    from megarl.checkpoint.resume import RunChecks, prepare_resume
    from megarl.data.loader import PromptStream
    from megarl.models.hf_io import load_hf_config
    from megarl.models.spec import spec_from_hf_config
    from megarl.trainer.rollout_host import training_source

    def model_spec() -> dict:
        return dataclasses.asdict(spec_from_hf_config(load_hf_config(model_dir)))

    def load_position(state) -> None:  # the rollout host's stream, as it will be built
        context = spec_from_hf_config(load_hf_config(model_dir)).max_position_embeddings
        if cfg.algo.is_sft:  # the conversations (the bad rows a run skips are not in it)
            from megarl.models.hf_io import load_hf_tokenizer
            from megarl.trainer.sft_batches import load_sft_examples

            tokenizer = load_hf_tokenizer(model_dir)
            source, _ = load_sft_examples(cfg, tokenizer, cfg.data.train_files or (), context)
        else:
            source, _ = training_source(cfg, model_dir, context)
        stream = PromptStream(cast("Any", source), cfg.data.prompts_per_step, cfg.trainer.seed)
        stream.load_state_dict(state)

    checks = RunChecks(model_spec=model_spec, model_dir=model_dir, load_position=load_position)
    try:
        return prepare_resume(cfg, checks)
    except CheckpointError as exc:
        raise StartupError(str(exc)) from None


def run(overrides: list[str], return_final_state: bool = False):
    """Compose, validate, and train; returns rank 0's :class:`RunResult`.

    ``trainer.run_dir`` is locked (one run per folder) once the checks that write nothing have
    passed, and before the resume check tidies the folder or the model is placed in it.
    """
    from megarl.trainer.rank_loop import RunInputs, run_rank

    cfg = compose_config(overrides)
    if problem := distill_problem(cfg):
        raise StartupError(problem)
    check_run_dir(cfg.trainer.run_dir)
    check_engine_installed(cfg.rollout.engine)
    check_loggers_installed(cfg.trainer.logger)
    device = resolve_device(cfg.trainer.device, cfg)
    with contextlib.ExitStack() as held:
        with (
            _storage_errors_named(cfg.trainer.run_dir, "start-up"),
            tempfile.TemporaryDirectory(prefix="megarl-init-") as tmp,
        ):
            staging = Path(tmp) / "init_model"
            model_dir = resolve_model_dir(cfg, staging)
            validate_against_model(cfg, model_dir, device)
            teacher_staging = Path(tmp) / TEACHER_FOLDER
            teacher_dir = resolve_teacher_dir(cfg, teacher_staging)
            if teacher_dir is not None:
                check_teacher(cfg, model_dir, teacher_dir)
            check_dump_dirs(cfg)
            held.enter_context(_hold_run_dir(cfg.trainer.run_dir))
            resume_from = resolve_resume(cfg, model_dir)
            model_dir = place_model_dir(cfg, model_dir, staging)
            if teacher_dir is not None:
                teacher_dir = place_model_dir(cfg, teacher_dir, teacher_staging, TEACHER_FOLDER)
        inputs = RunInputs(
            cfg=cfg,
            model_dir=model_dir,
            teacher_dir=teacher_dir,
            device=device,
            return_final_state=return_final_state,
            resume_from=resume_from,
        )
        return _launch(cfg, device, run_rank, inputs)[0]


@contextlib.contextmanager
def _storage_errors_named(run_dir: str, during: str) -> Iterator[None]:
    """A write of the launcher's own (the run directory's lock, the model placed in it, the
    resume check's tidying) that the storage refuses is one line, as a rank's is
    (:func:`megarl.errors.storage_error`); any other error passes unchanged."""
    from megarl.errors import storage_error

    try:
        yield
    except OSError as exc:
        error = storage_error(exc, run_dir, during)
        if error is None:
            raise
        raise error from None


@contextlib.contextmanager
def _hold_run_dir(run_dir: str) -> Iterator[None]:
    """The run directory's lock (see :mod:`megarl.distributed.run_lock`) for the ``with`` block;
    a folder the lock created is removed again if the run leaves it empty (refused by a check)."""
    from megarl.distributed.run_lock import run_lock

    existed = Path(run_dir).exists()
    try:
        with run_lock(run_dir):
            yield
    finally:
        if not existed:
            with contextlib.suppress(OSError):  # not empty: the run wrote its outputs
                Path(run_dir).rmdir()


# --- launcher dispatch ---------------------------------------------------
def _launch(cfg, device: str, fn, inputs) -> list:
    """Run ``fn`` on every rank: spawned processes here (local) or Ray actors (ray); under both,
    the ranks' heartbeats in ``<run_dir>/.heartbeat`` name a rank that stops."""
    from megarl.distributed.heartbeat import HeartbeatWatch
    from megarl.distributed.launcher import launch

    watch = HeartbeatWatch(
        str(Path(cfg.trainer.run_dir) / ".heartbeat"), cfg.trainer.collective_timeout_s
    )
    if cfg.trainer.launcher == "ray":
        from megarl.distributed.ray_launcher import PlacementError, RayLayout, launch_on_ray

        layout = RayLayout(cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, device)
        with _tracebacks_to_log(cfg):
            side = _split_rollout(cfg, inputs)
            try:
                return launch_on_ray(fn, layout, args=(inputs,), side=side, watch=watch)
            except PlacementError as exc:
                raise StartupError(str(exc)) from None
    with _tracebacks_to_log(cfg):
        return launch(fn, cfg.trainer.world_size, args=(inputs,), watch=watch)


@contextlib.contextmanager
def _tracebacks_to_log(cfg) -> Iterator[None]:
    """A rank that raised an unexpected error is reported in one line; its traceback goes to
    ``<run_dir>/logs/error-rank<N>.txt`` (named in that line) and, with ``trainer.debug`` or
    ``HYDRA_FULL_ERROR=1``, to the console. A one-rank run raises in this process: the same."""
    from megarl.distributed.launcher import RunStopped, WorkerFailed
    from megarl.errors import MegarlError

    try:
        yield
    except WorkerFailed as exc:
        if exc.traceback:
            _log_traceback(cfg, exc, exc.traceback)
        raise
    except (MegarlError, StartupError, RunStopped, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - a one-rank run's bug: reported like a rank's
        failed = WorkerFailed(0, None, f"{type(exc).__name__}: {exc}".splitlines()[0])
        _log_traceback(cfg, failed, traceback.format_exc())
        raise failed from None


def _log_traceback(cfg, failed, trace: str) -> None:
    """Write the traceback to the run's log; where that write fails too (the disk that made
    the run fail is full), print it on stderr instead and say why, never a second error."""
    name = f"rank{failed.rank}" if failed.rank >= 0 else "rollout"  # -1: the rollout actor
    path = Path(cfg.trainer.run_dir) / "logs" / f"error-{name}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(trace, encoding="utf-8")
    except OSError as exc:
        print(trace, file=sys.stderr, end="" if trace.endswith("\n") else "\n")
        failed.args = (f"{failed} (traceback above: {path} could not be written: {exc.strerror})",)
        return
    if cfg.trainer.debug or os.environ.get("HYDRA_FULL_ERROR") == "1":
        print(trace, file=sys.stderr, end="" if trace.endswith("\n") else "\n")
    failed.args = (f"{failed} (traceback: {path})",)


def _split_rollout(cfg, inputs):
    """``rollout.n_gpus > 0``: the rollout driver as its own Ray actor (None = colocated). On
    one CPU machine (a private Ray, one node) it gets ``rollout.n_gpus`` cores of its own and
    the ranks the rest (:func:`~megarl.distributed.execution.split_cpu_cores`)."""
    if cfg.rollout.n_gpus == 0:
        return None
    import dataclasses

    from megarl.distributed.ray_launcher import SideActor, forwarded_env
    from megarl.trainer.split_rollout import ASYNC_CONCURRENCY, RolloutActor

    cores = _cpu_core_split(cfg, inputs.device)
    rollout_cores = None if cores is None else cores.rollout
    rank_cores = None if cores is None else cores.ranks
    init_args = (cfg, inputs.model_dir, inputs.device, forwarded_env(), list(sys.path))
    return SideActor(
        role="rollout",
        cls=RolloutActor,
        n_gpus=cfg.rollout.n_gpus,
        init_args=(*init_args, rollout_cores),
        attach=lambda handle, args: (
            dataclasses.replace(args[0], rollout_actor=handle, rank_cores=rank_cores),
        ),
        max_concurrency=ASYNC_CONCURRENCY if cfg.async_training.is_async else 1,
    )


def _cpu_core_split(cfg, device: str):
    """How split placement shares this machine's cores, when it runs on this machine alone."""
    if device != "cpu" or cfg.trainer.nnodes != 1 or os.environ.get("RAY_ADDRESS"):
        return None
    from megarl.distributed.execution import split_cpu_cores

    available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
    cores = split_cpu_cores(sorted(available), cfg.rollout.n_gpus)
    if cores is not None:
        print(f"megarl ray: {cores.describe()}", file=sys.stderr, flush=True)
    return cores


def main(argv: list[str] | None = None) -> int:
    from megarl.distributed import heap
    from megarl.distributed.launcher import RunStopped, WorkerFailed, stop_on_signals
    from megarl.errors import MegarlError

    if argv is None:  # the command itself: its process is the run's (a world of one trains here)
        heap.own_this_process()  # a caller that passes argv keeps its process as it is
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(
            (__doc__ or "").strip()
            + "\n\nusage: megarl-train [key=value ...]   (see configs/config.yaml)"
        )
        return 0
    try:
        with stop_on_signals():
            run(args)
    except RunStopped as exc:  # SIGTERM / SIGINT: workers were terminated and joined
        print(f"megarl-train: {exc}: every rank was stopped", file=sys.stderr)
        return exc.exit_code
    except StartupError as exc:
        print(f"megarl-train: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except WorkerFailed as exc:  # a rank died or raised: one line names role, rank and node
        print(f"megarl-train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except MegarlError as exc:  # raised in this process (a one-rank run runs here)
        print(f"megarl-train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("megarl-train: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
