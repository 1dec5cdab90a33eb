"""Where a run's model folders come from: ``model.path`` (an HF folder, a ``.gguf``, a megarl
checkpoint or run folder), a random init, the distillation teacher; and how they are placed.

A run must not write into ``trainer.run_dir`` before every start-up check has passed, yet some
checks read the very folder a conversion writes. So a folder that is not already in place is
written to a staging path first, and :func:`place_model_dir` moves it into the run directory
only once the run is accepted. The teacher follows the same path under its own name.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from megarl.errors import StartupError


def resolve_model_dir(cfg, staging: Path | None = None) -> str:
    """A checked HF folder for the run: the packaged SmolLM2, ``model.path``, or one megarl writes.

    megarl writes the folder itself for a random init (``model.hf_config``) or a megarl checkpoint
    given as ``model.path``; its place is ``<run_dir>/init_model``, reused when it already holds
    that model. With ``staging`` (a path in a temporary folder) a folder not already in place is
    written there instead, and :func:`place_model_dir` moves it into the run directory once every
    check has passed, so a run refused by a later check leaves ``trainer.run_dir`` untouched.
    Validating before writing would not do: the later checks read the written folder.
    """
    from megarl.models.hf_io import resolve_model_path
    from megarl.models.validate import ModelPathError

    final = Path(cfg.trainer.run_dir) / "init_model"
    try:
        if cfg.model.hf_config is not None:
            from megarl.models.random_init import is_saved, save_random_hf_model

            hf_config, seed = cfg.model.hf_config, cfg.model.init_seed
            out = staging if staging and not is_saved(hf_config, seed, final) else final
            return str(resolve_model_path(save_random_hf_model(hf_config, seed, out)))
        checkpoint = megarl_checkpoint_of(cfg.model.path) if cfg.model.path else None
        if checkpoint is not None:
            from megarl.checkpoint.convert import (
                ConvertError,
                hf_folder_for_training,
                is_training_folder_current,
            )

            try:  # a converted or training checkpoint: train from its weights
                current = is_training_folder_current(checkpoint, final)
                out = staging if staging and not current else final
                return str(resolve_model_path(hf_folder_for_training(checkpoint, out)))
            except ConvertError as exc:
                raise StartupError(f"model.path={cfg.model.path}: {exc}") from None
        return str(resolve_model_path(cfg.model.path))
    except ModelPathError as exc:
        raise StartupError(str(exc)) from None


def resolve_teacher_dir(cfg, staging: Path) -> str | None:
    """``algo.distill.teacher_path`` as an HF folder (None without a teacher), resolved as
    ``model.path`` is: a megarl run folder's newest checkpoint, or a checkpoint, is converted
    once, into ``staging`` unless ``<run_dir>/teacher_model`` already holds it; the caller
    moves it there once every check has passed (:func:`place_model_dir`), so a refused start
    writes nothing into the run directory."""
    from megarl.models.hf_io import resolve_model_path
    from megarl.models.validate import ModelPathError

    path = cfg.algo.distill.teacher_path
    if path is None:
        return None
    key = f"algo.distill.teacher_path={path}"
    try:
        checkpoint = megarl_checkpoint_of(path, key="algo.distill.teacher_path")
        if checkpoint is None:
            return str(resolve_model_path(path))
        from megarl.checkpoint.convert import (
            ConvertError,
            hf_folder_for_training,
            is_training_folder_current,
        )

        try:
            final = Path(cfg.trainer.run_dir) / TEACHER_FOLDER
            out = final if is_training_folder_current(checkpoint, final) else staging
            return str(resolve_model_path(hf_folder_for_training(checkpoint, out)))
        except ConvertError as exc:
            raise StartupError(f"{key}: {exc}") from None
    except ModelPathError as exc:  # its message names model.path: name the teacher's key
        message = str(exc).splitlines()[0]
        if message.startswith("model.path="):
            message = message.split(": ", 1)[-1]
        raise StartupError(f"{key}: {message}") from None


def check_teacher(cfg, model_dir: str, teacher_dir: str) -> None:
    """The teacher scores the student's token ids as they are: it must share the model's
    tokenizer, and its own shape must split over the actor's TP/PP (it runs with them)."""
    from megarl.algo.distill import tokenizer_mismatch
    from megarl.models.hf_io import load_hf_config, load_hf_tokenizer
    from megarl.models.spec import ModelSpecError, spec_from_hf_config

    key = f"algo.distill.teacher_path={cfg.algo.distill.teacher_path}"
    student, teacher = load_hf_tokenizer(model_dir), load_hf_tokenizer(teacher_dir)
    problem = tokenizer_mismatch(student.get_vocab(), teacher.get_vocab())
    if problem:
        raise StartupError(
            f"{key}: its tokenizer differs from the model's ({problem}); on-policy distillation "
            "needs one tokenizer for both"
        )
    try:
        spec = spec_from_hf_config(load_hf_config(teacher_dir))
        spec.check_parallelism(cfg.actor.tp, cfg.actor.pp, cfg.actor.vpp, cfg.actor.ep)
    except (ModelSpecError, ValueError) as exc:
        raise StartupError(f"{key}: {str(exc).splitlines()[0]}") from None


def distill_problem(cfg) -> str | None:
    """Pure distillation (``algo.distill.reward_coef=0``, ``recipe=opd``) without a teacher
    would train on nothing: the teacher must be named on the command line."""
    distill = cfg.algo.distill
    if distill.reward_coef == 0 and not distill.enabled:
        return (
            "algo.distill.reward_coef=0 (recipe=opd) needs a teacher: add "
            "algo.distill.teacher_path=<a Hugging Face folder or a megarl run folder>"
        )
    return None


TEACHER_FOLDER = "teacher_model"
"""Where a converted teacher checkpoint is placed in the run directory."""


def place_model_dir(cfg, model_dir: str, staging: Path, name: str = "init_model") -> str:
    """Move a folder :func:`resolve_model_dir` (or :func:`resolve_teacher_dir`) wrote to
    ``staging`` into ``<run_dir>/<name>``; any other folder is used where it is. A folder of
    that name an earlier run left there is kept when it holds the same bytes (a resume writes
    the same model again), and otherwise renamed aside (``replaced-<time>-<name>``, said on the
    console), never deleted: a run may have started from it."""

    from megarl.checkpoint.layout import set_aside

    if Path(model_dir) != staging:
        return model_dir
    final = Path(cfg.trainer.run_dir) / name
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and _same_files(final, staging):
        shutil.rmtree(staging)  # this run's own copy of what is already there
        return str(final)
    if final.exists():
        moved = set_aside(final, "replaced-")
        print(f"megarl-train: an earlier {final} was renamed to {moved.name}", file=sys.stderr)
    shutil.move(str(staging), str(final))
    return str(final)


def _same_files(a: Path, b: Path) -> bool:
    import filecmp

    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors


def is_megarl_checkpoint(path: str) -> bool:
    from megarl.checkpoint.layout import MARKER

    return (Path(path).expanduser() / MARKER).is_file()


def megarl_checkpoint_of(path: str, key: str = "model.path") -> str | None:
    """``model.path`` as a megarl checkpoint: the folder itself, or a run folder's newest
    complete checkpoint (e.g. an SFT run's, to continue with RL); None for anything else. A
    run folder whose newest checkpoint is damaged stops the start rather than fall back."""
    from megarl.checkpoint.layout import DamagedCheckpointError, checkpoints_dir, latest_checkpoint

    if is_megarl_checkpoint(path):
        return path
    if not checkpoints_dir(Path(path).expanduser()).is_dir():
        return None
    try:
        newest = latest_checkpoint(Path(path).expanduser())
    except DamagedCheckpointError as exc:
        raise StartupError(f"{key}={path}: the newest checkpoint is damaged: {exc}") from None
    if newest is None:
        raise StartupError(f"{key}={path}: a run folder without a complete checkpoint")
    return str(newest.path)
