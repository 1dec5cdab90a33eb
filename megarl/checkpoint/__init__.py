"""Training checkpoints and HF <-> Megatron conversion, in one simple on-disk format.

Format (one directory per checkpoint, ``<run_dir>/checkpoints/step_000006``)::

    megarl_checkpoint.json       completeness marker, written last: step, layout, config, files
                                 with their sizes, the id of the run directory that wrote it
    model_tp{t}_pp{p}.safetensors   this (TP, PP) rank's Megatron shards, Megatron names with
                                    *global* layer numbers (written by its DP-rank-0 replica)
    optim_tp{t}_pp{p}.safetensors   Adam state of the same shards (exp_avg, exp_avg_sq, step;
                                    on CUDA also main_param, the fp32 main copy of a bf16 weight)
    rng_rank{r}.pt               torch / numpy / python RNG states of global rank r
    driver.json                  rank 0's data-stream position
    config.json, tokenizer*      the model's HF config and tokenizer (a checkpoint is a model)

Why our own format and not ``megatron.core.dist_checkpointing``: dist_checkpointing does work on
CPU/gloo, but (1) its async writer starts a spawn-context ``multiprocessing`` Manager that
re-imports ``__main__``, so every entry point (pytest, notebooks, user scripts) must be guarded
or the save hangs forever; (2) on CPU our optimizer is a plain ``torch.optim.AdamW`` whose state
has no ``sharded_state_dict``; (3) the conversion tools would need a process group to read it.
Megatron's own optimizer (CUDA) is brought to the same per-parameter form rather than saved
through its ``sharded_state_dict``: the distributed optimizer's data-parallel slices are gathered
into whole parameters (:mod:`megarl.actor.megatron_optim_state`), so one format serves CPU and
GPU and reshards the same way. Each rank writes plain safetensors of its own shards (the only
collective before the write is that gather; no helper processes), and loading reads tensors
lazily by name. Loading at another TP/PP layout
goes through the same per-family layout table as HF loading and export
(:mod:`megarl.models.mapping`: saved shards -> HF tensors -> new shards), which is bitwise, so a
resharded resume is exact, not approximately equal.

Atomicity: a checkpoint is written under ``.tmp-step_N``; the marker is written (and fsynced)
last, then the directory is renamed. A directory named ``step_N`` therefore always carries a
marker, and a ``kill -9`` at any moment leaves the previous complete checkpoint untouched.
Pruning renames before deleting, so a half-deleted checkpoint never looks complete either.
"""
