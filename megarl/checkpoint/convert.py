"""``megarl-convert``: Hugging Face <-> Megatron checkpoints, offline (no process group, no GPU).

    megarl-convert hf-to-mcore --hf PATH --out DIR --tp N --pp M
    megarl-convert mcore-to-hf --ckpt DIR --out DIR [--lora | --merge-lora]

``--hf`` is a HF safetensors folder or a ``.gguf`` file (dequantised once, see
:mod:`megarl.models.hf_io`). ``hf-to-mcore`` writes the same per-rank shard files as a training
checkpoint (:mod:`megarl.checkpoint`), plus the HF config and tokenizer, so the result is also a
``model.path`` for megarl-train. ``--ckpt`` takes a converted checkpoint, a training checkpoint,
or a run directory (its latest complete checkpoint). ``mcore-to-hf`` writes ``model.safetensors``
+ ``config.json`` + tokenizer files that plain ``transformers`` loads. For a checkpoint of a LoRA
run, ``--lora`` also writes a PEFT adapter folder ``<out>-lora`` (``PeftModel.from_pretrained``
loads it on ``<out>``) and ``--merge-lora`` writes the weights with the adapter merged in; both
assemble the adapter from the shard files (:mod:`megarl.checkpoint.lora_shards`).

Both directions go through :mod:`megarl.models.mapping`, so HF -> Megatron -> HF is bitwise.
Bad input is one line on stderr and exit code 2; the output folder is written under a temporary
name and renamed when complete, so ``--out`` is either absent or whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from megarl.checkpoint import layout

if TYPE_CHECKING:
    import torch

    from megarl.models.lora import LoraSettings

EXIT_BAD_INPUT = 2
HF_WEIGHTS_FILE = "model.safetensors"
SOURCE_STAMP = "megarl_source.json"


class ConvertError(ValueError):
    """Bad input for a conversion; printed as one line."""


# --- hf-to-mcore ---------------------------------------------------------------------------


def hf_to_mcore(hf: str, out: str, tp: int, pp: int, progress: bool = True) -> Path:
    """Shard a HF checkpoint for TP=``tp`` x PP=``pp``; returns the written folder."""
    from megarl.checkpoint.shards import save_tensors, stage_params
    from megarl.checkpoint.trainer_state import copy_model_side_files
    from megarl.models import mapping
    from megarl.models.hf_io import open_hf_tensors, resolve_model_path
    from megarl.models.spec import ModelSpecError
    from megarl.models.validate import ModelPathError

    target = _fresh_output(out)
    try:
        folder = resolve_model_path(hf)
        spec = _spec_of(folder)
        read = open_hf_tensors(folder)
    except ModelPathError as exc:
        raise ConvertError(str(exc).replace("model.path=", "--hf ")) from None
    _check_layout(spec, tp, pp)
    jobs = [(t, p, list(stage_params(spec, p, pp))) for p in range(pp) for t in range(tp)]
    with (
        _staging(target) as staging,
        _progress_bar(progress, "hf-to-mcore", sum(len(j[2]) for j in jobs)) as advance,
    ):
        for tp_rank, pp_rank, params in jobs:
            shards = {}
            for rule, layer in params:
                try:
                    hf_tensors = [read(name) for name in rule.hf_names(layer)]
                    shards[rule.mcore_name(layer)] = mapping.to_mcore_shard(
                        rule, hf_tensors, spec, tp_rank, tp
                    )
                except (ModelPathError, ModelSpecError) as exc:
                    raise ConvertError(str(exc).replace("model.path=", "--hf ")) from None
                advance()
            save_tensors(shards, staging / layout.model_file(tp_rank, pp_rank))
        copy_model_side_files(folder, staging)
        marker = {
            "format": layout.FORMAT_VERSION,
            "kind": "converted",
            "step": 0,
            "layout": {"tp": tp, "pp": pp},
            "spec": dataclasses.asdict(spec),
            "source": str(Path(hf).expanduser().resolve()),
            "files": sorted(p.name for p in staging.iterdir()),
            "sizes": layout.file_sizes(staging),
        }
        layout.write_json_durably(staging / layout.MARKER, marker)
    return target


def _spec_of(folder: Path):
    from megarl.models.spec import ModelSpecError, spec_from_hf_config

    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{folder}: no config.json")
    try:
        return spec_from_hf_config(json.loads(config_path.read_text(encoding="utf-8")))
    except (ModelSpecError, KeyError, ValueError) as exc:
        raise ConvertError(f"{config_path}: {str(exc).splitlines()[0]}") from None


def _check_layout(spec, tp: int, pp: int) -> None:
    from megarl.models.spec import ModelSpecError

    try:
        spec.check_parallelism(tp, pp)
    except ModelSpecError as exc:
        raise ConvertError(
            str(exc).replace("actor.tp=", "--tp ").replace("actor.pp=", "--pp ")
        ) from None


# --- mcore-to-hf ---------------------------------------------------------------------------


def find_checkpoint(path: str | os.PathLike) -> layout.CheckpointInfo:
    """A checkpoint folder, or a run directory's latest complete checkpoint."""
    path = Path(path).expanduser()
    if not (path / layout.MARKER).exists() and layout.checkpoints_dir(path).is_dir():
        try:
            latest = layout.latest_checkpoint(path)
        except layout.DamagedCheckpointError as exc:
            raise ConvertError(
                f"{exc.problem}; it is the newest in --ckpt {path}: repair it or pass the "
                "checkpoint to convert"
            ) from None
        if latest is None:
            raise ConvertError(f"--ckpt {path}: run directory has no complete checkpoint")
        return latest
    try:
        return layout.read_checkpoint(path)
    except layout.CheckpointError as exc:
        raise ConvertError(str(exc)) from None


def mcore_to_hf(
    ckpt: str, out: str, progress: bool = True, lora: bool = False, merge_lora: bool = False
) -> list[Path]:
    """Reassemble a checkpoint's shards into a plain HF folder; returns the written folders.

    ``lora``: also a PEFT adapter folder ``<out>-lora`` beside it (base weights in ``out``,
    which the adapter config names as its base model). ``merge_lora``: ``out`` holds the base
    weights with the adapter merged in (``W + alpha/r * B @ A``).
    """
    if lora and merge_lora:
        raise ConvertError(
            "--lora and --merge-lora: choose one (an adapter on merged weights would apply twice)"
        )
    target = _fresh_output(out)
    info = find_checkpoint(ckpt)
    adapter_target = target.with_name(f"{target.name}-lora")
    if lora:
        _fresh_output(str(adapter_target))
    adapter = read_lora_adapter(info) if lora or merge_lora else None
    merge = None
    if merge_lora and adapter is not None:
        merge = MergeAdapter(adapter.tensors, adapter.settings.scaling)
    with _staging(target) as staging:
        write_hf_folder(info, staging, progress, merge=merge)
        if lora and adapter is not None:
            from megarl.export.lora import save_peft_adapter

            with _staging(adapter_target) as adapter_staging:
                save_peft_adapter(
                    adapter_staging,
                    adapter.tensors,
                    adapter.settings,
                    _spec_of(info.path),
                    base_model=str(target.resolve()),
                )
    return [target, adapter_target] if lora else [target]


class LoraAdapter(NamedTuple):
    """A checkpoint's LoRA adapter: peft-named fp32 tensors and the run's settings."""

    tensors: dict[str, torch.Tensor]
    settings: LoraSettings


class MergeAdapter(NamedTuple):
    """An adapter to merge into the base weights: ``W + scaling * B @ A``."""

    tensors: Mapping[str, torch.Tensor]
    scaling: float


def read_lora_adapter(info: layout.CheckpointInfo) -> LoraAdapter:
    """The LoRA adapter assembled from a checkpoint's shard files."""
    from megarl.checkpoint.lora_shards import peft_adapter_from_checkpoint
    from megarl.checkpoint.shards import ShardReader
    from megarl.models.lora import LoraSettings

    lora_cfg = info.marker.get("config", {}).get("actor", {}).get("lora", {})
    if int(lora_cfg.get("rank", 0)) < 1:
        raise ConvertError(
            f"--ckpt {info.path}: checkpoint holds no LoRA adapter (saved "
            "without actor.lora.rank > 0); drop --lora/--merge-lora"
        )
    settings = LoraSettings(
        rank=int(lora_cfg["rank"]),
        alpha=float(lora_cfg["alpha"]),
        dropout=float(lora_cfg.get("dropout", 0.0)),
        target_modules=tuple(lora_cfg["target_modules"]),
    )
    spec = _spec_of(info.path)
    try:
        reader = ShardReader(info, spec)
        adapter = peft_adapter_from_checkpoint(
            reader.read, reader.saved_tp, spec, settings.target_modules
        )
    except layout.CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    return LoraAdapter(adapter, settings)


def write_hf_folder(
    info: layout.CheckpointInfo,
    out: Path,
    progress: bool = True,
    merge: MergeAdapter | None = None,
) -> None:
    """``model.safetensors`` + config + tokenizer of ``info`` into the existing folder ``out``.

    ``merge``: a peft-named adapter and its scaling, merged into the weights before writing.
    """
    from megarl.checkpoint.shards import ShardReader, hf_state_from_checkpoint, save_tensors
    from megarl.checkpoint.trainer_state import copy_model_side_files
    from megarl.models import mapping

    spec = _spec_of(info.path)
    num_rules = sum(
        spec.num_layers if r.per_layer else 1
        for r in mapping.rules_for(spec)
        if not (r.mcore == "output_layer.weight" and spec.tie_embeddings)
    )
    try:
        reader = ShardReader(info, spec)
        with _progress_bar(progress, "mcore-to-hf", num_rules) as advance:
            state = hf_state_from_checkpoint(reader, advance)
    except layout.CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    if merge is not None:
        from megarl.export.lora import merge_adapter_into_hf

        state = merge_adapter_into_hf(state, *merge)
    save_tensors(state, out / HF_WEIGHTS_FILE)
    copy_model_side_files(info.path, out)


def hf_folder_for_training(path: str | os.PathLike, out: Path) -> Path:
    """``model.path`` pointing at a megarl checkpoint: its HF folder, written once to ``out``."""
    info = find_checkpoint(path)
    if is_training_folder_current(path, out):
        return out
    if out.exists():
        shutil.rmtree(out)
    with _staging(out) as staging:
        write_hf_folder(info, staging, progress=False)
        (staging / SOURCE_STAMP).write_text(json.dumps(_source_stamp(info)))
    return out


def is_training_folder_current(path: str | os.PathLike, out: Path) -> bool:
    """``out`` already holds the HF folder of the checkpoint ``path`` names (same step, same save)."""
    stamp_path = Path(out) / SOURCE_STAMP
    return stamp_path.is_file() and json.loads(stamp_path.read_text()) == _source_stamp(
        find_checkpoint(path)
    )


def _source_stamp(info: layout.CheckpointInfo) -> dict:
    return {
        "source": str(info.path.resolve()),
        "step": info.step,
        "marker_mtime": (info.path / layout.MARKER).stat().st_mtime,
    }


# --- shared plumbing -------------------------------------------------------------------------


def _fresh_output(out: str) -> Path:
    target = Path(out).expanduser()
    if target.exists():
        raise ConvertError(f"--out {target} already exists (refusing to overwrite)")
    if not target.parent.is_dir():
        raise ConvertError(f"--out {target}: parent folder does not exist")
    return target


class _staging:
    """Write into ``.tmp-<name>`` beside ``target``; rename on success, delete on any error."""

    def __init__(self, target: Path):
        self.target = target
        self.path = target.with_name(f"{layout.TMP_PREFIX}{target.name}-{os.getpid()}")

    def __enter__(self) -> Path:
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            os.replace(self.path, self.target)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


class _progress_bar:
    """A rich progress bar on stderr; ``advance()`` is a no-op when disabled."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled, self.label, self.total = enabled, label, total
        self._progress = None

    def __enter__(self) -> Callable[[], None]:
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        progress = self._progress = Progress(
            TextColumn(f"[bold]{self.label}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=Console(file=sys.stderr),
        )
        task = progress.add_task(self.label, total=self.total)
        progress.start()
        return lambda: progress.advance(task)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


# --- command line ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl-convert", description=(__doc__ or "").split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    to_mcore = commands.add_parser("hf-to-mcore", help="HF folder or .gguf -> Megatron shards")
    to_mcore.add_argument("--hf", required=True, help="HF safetensors folder or .gguf file")
    to_mcore.add_argument("--out", required=True, help="new folder to write")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    to_hf = commands.add_parser("mcore-to-hf", help="megarl checkpoint -> HF folder")
    to_hf.add_argument(
        "--ckpt", required=True, help="converted or training checkpoint, or a run directory"
    )
    to_hf.add_argument("--out", required=True, help="new folder to write")
    to_hf.add_argument(
        "--lora", action="store_true", help="also write a PEFT adapter folder <out>-lora"
    )
    to_hf.add_argument("--merge-lora", action="store_true", help="merge LoRA into the weights")
    for sub in (to_mcore, to_hf):
        sub.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "hf-to-mcore":
            out = hf_to_mcore(args.hf, args.out, args.tp, args.pp, not args.no_progress)
        else:
            out = mcore_to_hf(
                args.ckpt,
                args.out,
                not args.no_progress,
                lora=args.lora,
                merge_lora=args.merge_lora,
            )
    except ConvertError as exc:
        print(f"megarl-convert: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for folder in out if isinstance(out, list) else [out]:
        print(f"megarl-convert: wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
