"""The weight sync into a rollout-side engine, side by side: HF layout into the transformers
engine against Megatron layout into the Megatron engine's TP=1 copy.

Run: ``python benchmarks/bench_megatron_copy_sync.py [--repeats 5] [--bucket-mb 64]
[--checksums]``
(CPU; the packaged SmolLM2-135M-Instruct in fp32).

In one process, a world of one: the trainer's model (a Megatron ``GPTModel``, TP=1) streams its
weights through the real exporter (``megarl.export.sync.sync_engine_weights``) -- once as HF
tensors (fused q/k/v and gate/up split by the mapping tables) into ``HFEngine``, once as whole
Megatron parameters (``megatron_layout``) into ``MegatronCopy``, the way a split run with
``rollout.engine=hf`` or ``megatron`` syncs after every step (over Ray there, which adds the
same object-store copy to both). Interleaved, ``--repeats`` times after a warm-up; the medians
and their ratio are printed; with ``--checksums`` also with the checksum pass
(``export.checksum_interval``, ~25 s a sync here: it dominates the run).
Both engines then generate the demo's greedy tokens from the synced weights: they must agree.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--checksums", action="store_true")
    args = parser.parse_args()

    import torch

    from megarl.distributed import parallel
    from megarl.distributed.platform import cpu_shims
    from megarl.engines.base import SamplingParams
    from megarl.engines.hf import HFEngine
    from megarl.engines.megatron import MegatronEngine
    from megarl.engines.megatron_copy import build_megatron_copy
    from megarl.export.sync import sync_engine_weights
    from megarl.models.hf_io import (
        load_hf_config,
        load_hf_model,
        load_hf_state_dict,
        load_hf_tokenizer,
        resolve_model_path,
    )
    from megarl.models.megatron_gpt import build_gpt_model, iter_local_params, load_hf_weights
    from megarl.models.spec import spec_from_hf_config
    from megarl.trainer.engine_setup import megatron_engine_kwargs

    model_dir = str(resolve_model_path(None))
    spec = spec_from_hf_config(load_hf_config(model_dir))
    tokenizer = load_hf_tokenizer(model_dir)
    state = load_hf_state_dict(model_dir)
    parallel.init_process_group("cpu", 0, 1, "127.0.0.1", 0)
    parallel.init_model_parallel(1, 1)
    with cpu_shims():
        trainer = build_gpt_model(spec, 1, 1)
        load_hf_weights(trainer, spec, state)
        with torch.no_grad():  # the trainer has moved: both engines must take its weights
            for param in trainer.parameters():
                param.mul_(1.001)
        copy = build_megatron_copy(spec, state, torch.float32, "cpu")
        megatron = MegatronEngine(**megatron_engine_kwargs(tokenizer, model_dir, spec, "cpu"))
        megatron.bind_copy(copy)
        hf_model, _ = load_hf_model(model_dir, device="cpu")
        hf = HFEngine(hf_model, tokenizer)

        def sync(engine, megatron_layout: bool, checksum: bool) -> float:
            t0 = time.perf_counter()
            sync_engine_weights(
                iter_local_params(trainer, spec),
                spec,
                args.bucket_mb,
                1,
                checksum,
                engine,
                megatron_layout=megatron_layout,
            )
            return time.perf_counter() - t0

        checksum_modes = (False, True) if args.checksums else (False,)
        cases = {
            (name, checksum): functools.partial(sync, engine, name == "megatron", checksum)
            for checksum in checksum_modes
            for name, engine in (("hf", hf), ("megatron", megatron))
        }
        for case in cases.values():  # warm-up
            case()
        seconds: dict = {key: [] for key in cases}
        for _ in range(args.repeats):
            for key, case in cases.items():
                seconds[key].append(case())
        prompts = [list(tokenizer("What is 12 + 7?")["input_ids"])] * 4
        params = SamplingParams(temperature=0.0, max_new_tokens=12)
        same = [g.response_ids for g in megatron.generate(prompts, params)] == [
            g.response_ids for g in hf.generate(prompts, params)
        ]
    med = {key: statistics.median(values) for key, values in seconds.items()}
    print(
        f"SmolLM2-135M-Instruct fp32, {spec.num_parameters() * 4 / 2**20:.0f} MiB per sync, "
        f"buckets of {args.bucket_mb} MiB, {torch.get_num_threads()} torch threads, "
        f"{args.repeats} interleaved repeats (medians)"
    )
    for checksum in checksum_modes:
        hf_s, mg_s = med["hf", checksum], med["megatron", checksum]
        label = "with checksums" if checksum else "plain"
        print(
            f"{label:<15} HF layout -> transformers engine {hf_s:.3f} s | Megatron layout -> "
            f"Megatron copy {mg_s:.3f} s | ratio {mg_s / hf_s:.2f}"
        )
    print(f"greedy tokens of the two engines after the sync agree: {same}")
    parallel.destroy()


if __name__ == "__main__":
    main()
