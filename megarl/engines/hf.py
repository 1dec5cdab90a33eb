"""The embedded rollout engine: a hand-written sampling loop over a ``transformers`` model.

Why not ``model.generate``: the trainer compares the engine's per-token logprobs with its own
(``rollout/logprob_abs_diff``), so the engine must report exactly
``log_softmax(logits / temperature)[token]`` of the untruncated distribution, and a rollout
must be reproducible from (weights, requests) alone. Owning the loop makes both explicit:
logits are read before any processor touches them and handed to
:mod:`megarl.engines.sampling`, which draws each response token from its own seed (the
contract every engine that owns its loop shares). A response interrupted and resumed
therefore draws the same tokens as an uninterrupted call would: same weights, same tokens,
logprobs equal up to the floating-point difference between a cached decode step and a prefill.

Batching (:mod:`megarl.engines.batching`): contexts (prompt, then any tokens of an earlier call)
are left-padded so that every row's next token sits in the last column. Pad positions are masked
out of attention and given dummy position ids; real tokens get positions ``0..len-1`` as in an
unpadded forward, so a row's logits do not depend on what it was batched with, up to the GEMM's
rounding on other shapes (the unit tests check this against a one-sequence full forward). Each
distinct context is run once to fill a ``DynamicCache`` (GRPO's ``n`` samples of a prompt share
one prefill), whose rows are then copied out to one per request; each step then feeds one token
per row. A row ends on EOS or when it has used its own budget (``max_new_tokens`` minus the
tokens it came with), and the step that ends it drops it from the cache, so later steps compute
only the rows still going. An ``interrupt`` event is polled after each step's draw (so every call
samples at least one token per row): once it is set the loop stops and the rows still going
come back ``interrupted``.

Routing: for a mixture-of-experts model the engine also reports, per response token and layer,
the experts the router picked in the forward that produced the token's logprob (the prefill's
last column for the first token, then each decode step's one column), read by a forward hook
from the router itself (:class:`RouterTap`), so they are exactly the experts the engine used;
and the prefill's experts of every other prompt position, which router replay
(``actor.router_replay.mode=R3``) needs.

Memory: ``sleep(2)`` swaps every base parameter's storage for an empty tensor (the Parameter
objects, and so tied embeddings, survive), ``wake_up`` re-allocates uninitialised storage and
the engine reports ``base_weights_resident=False`` until every base parameter has been resent
through ``update_weights``. ``sleep(1)`` keeps the weights, moving them to host memory when
the engine runs on an accelerator.

The engine takes ownership of the model it is given: it moves it to ``device``, puts it in
eval mode, turns off gradients, and may free or wrap its layers.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megarl.algo.routing_mismatch import expert_id_dtype
from megarl.engines.base import (
    EngineMemoryState,
    GenerateCall,
    Generation,
    LoraAdapter,
    RolloutEngine,
    default_eos_token_ids,
    merge_token_ids,
)
from megarl.engines.batching import DistinctContexts, left_pad
from megarl.engines.sampling import ResponseState, sample_step
from megarl.export.checksum import tensor_checksum
from megarl.export.lora import PEFT_PREFIX
from megarl.models.hooks import forward_hooks

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ADAPTER_NAME = "default"
"""The one adapter slot this engine uses inside PEFT layers."""


# --- token-id plumbing -----------------------------------------------------------------------


def resolve_eos_token_ids(
    explicit: Sequence[int] | None,
    tokenizer: PreTrainedTokenizerBase | None,
    model: PreTrainedModel,
) -> tuple[int, ...]:
    """EOS ids to stop on: the explicit ones, else the tokenizer's plus the generation config's."""
    if explicit is None:
        return default_eos_token_ids(tokenizer, getattr(model, "generation_config", None))
    ids = merge_token_ids(explicit)
    if not ids:
        raise ValueError("no EOS token id known: pass eos_token_ids or a tokenizer that has one")
    return ids


def resolve_pad_token_id(
    explicit: int | None, tokenizer: PreTrainedTokenizerBase | None, eos_token_ids: Sequence[int]
) -> int:
    """Id used for left padding; its value never matters (pad positions are masked out)."""
    if explicit is not None:
        return explicit
    tokenizer_pad = getattr(tokenizer, "pad_token_id", None)
    return tokenizer_pad if tokenizer_pad is not None else eos_token_ids[0]


# --- LoRA (PEFT) -----------------------------------------------------------------------------


def parse_peft_lora_name(name: str) -> tuple[str, str]:
    """Split a PEFT adapter tensor name into (module path in the HF model, "lora_A"|"lora_B").

    Accepts ``get_peft_model_state_dict`` names
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), the same without the
    ``base_model.model.`` prefix, and names that still carry the adapter name
    (``...lora_A.default.weight``).
    """
    stripped = name.removeprefix(PEFT_PREFIX)
    for which in ("lora_A", "lora_B"):
        for suffix in (f".{which}.weight", f".{which}.{ADAPTER_NAME}.weight"):
            if stripped.endswith(suffix):
                return stripped[: -len(suffix)], which
    raise ValueError(f"LoRA tensor {name!r} is not a PEFT lora_A/lora_B weight name")


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """Module path -> PEFT LoRA layer, for every layer currently injected."""
    from peft.tuners.lora import LoraLayer

    return {path: module for path, module in model.named_modules() if isinstance(module, LoraLayer)}


def remove_lora_layers(model: torch.nn.Module) -> None:
    """Put every PEFT-wrapped module's original layer back, dropping the adapter weights."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for path, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent_path, _, child_name = path.rpartition(".")
            setattr(model.get_submodule(parent_path), child_name, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config


def _copy_lora_tensors(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy adapter tensors into the injected LoRA layers; every layer must get A and B."""
    layers = _lora_layers(model)
    missing = {(path, which) for path in layers for which in ("lora_A", "lora_B")}
    for name, tensor in named_tensors:
        path, which = parse_peft_lora_name(name)
        if path not in layers:
            raise ValueError(f"LoRA tensor {name!r} targets {path!r}, which has no LoRA layer")
        weight = getattr(layers[path], which)[ADAPTER_NAME].weight
        if tuple(tensor.shape) != tuple(weight.shape):
            raise ValueError(
                f"LoRA tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(weight.shape)}"
            )
        weight.copy_(tensor)
        missing.discard((path, which))
    if missing:
        shown = sorted(f"{path}.{which}" for path, which in missing)[:4]
        raise ValueError(f"adapter is missing {len(missing)} LoRA tensors, e.g. {shown}")


# --- mixture-of-experts routing --------------------------------------------------------------


def find_hf_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of a transformers mixture-of-experts model, in layer order: transformers
    5 keeps each at the decoder's ``layers[N].mlp.gate`` (Qwen3-MoE, Qwen2-MoE and Mixtral alike), a
    module with a ``top_k`` whose forward returns ``(logits, weights, expert ids)``. Empty for a
    dense model (a dense MLP's ``gate`` is the gate projection, which has no ``top_k``)."""
    return [
        module
        for name, module in model.named_modules()
        if name.endswith("mlp.gate") and hasattr(module, "top_k")
    ]


class RouterTap:
    """Reads the expert ids each router of a transformers MoE model picks.

    Why a hook on the router rather than ``output_router_logits=True``: that returns only the
    logits (the top-k would have to be recomputed, with its own tie-breaking) and makes the
    causal-LM forward compute the load-balancing loss against the attention mask, whose shape
    does not match one cached decode column. The router's own third output is the ``[tokens,
    top_k]`` ids its ``torch.topk`` chose, the experts the engine then ran.
    """

    def __init__(self, routers: Sequence[torch.nn.Module], num_experts: int) -> None:
        self.routers = list(routers)
        self.id_dtype = expert_id_dtype(num_experts)
        self._seen: list[torch.Tensor] = []

    @contextlib.contextmanager
    def attached(self) -> Iterator[RouterTap]:
        """Hook every router while the block runs."""
        self._seen = []
        try:
            with forward_hooks(self.routers, self._hook):
                yield self
        finally:
            self._seen = []

    def _hook(self, _router: torch.nn.Module, _inputs: tuple, output: tuple) -> None:
        self._seen.append(output[2])

    def columns(self, batch_size: int) -> torch.Tensor:
        """``[B, T, layers, top_k]`` expert ids of every position of the forward that just ran
        (the prefill's ``T`` left-padded columns, or a decode step's one); forgets that
        forward."""
        if len(self._seen) != len(self.routers):
            raise RuntimeError(f"{len(self._seen)} router outputs for {len(self.routers)} routers")
        columns = [ids.reshape(batch_size, -1, ids.shape[-1]) for ids in self._seen]
        self._seen = []
        return torch.stack(columns, dim=2).to(self.id_dtype).cpu()

    def last_column(self, batch_size: int) -> torch.Tensor:
        """``[B, layers, top_k]`` expert ids of the last position of each row in the forward that
        just ran (the one whose logits were sampled from); forgets that forward."""
        return self.columns(batch_size)[:, -1]


def row_routing(
    response: ResponseState, row: int, routing: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The routed experts of ``response`` (batch ``row``) and of its prompt, from the call's
    ``(prefill_BTLK, routing_BSLK)``; the prompt's only on its first call (None, None for a
    dense model)."""
    if routing is None:
        return None, None
    prefill_BTLK, routing_BSLK = routing
    routed = routing_BSLK[row, : len(response.tokens)].clone()
    if response.request.generated_ids:
        return routed, None
    # left-padded: the row's prompt is the last P columns; the last one scored response token 0
    # and is already routed[0]
    width, prompt_len = prefill_BTLK.shape[1], len(response.request.prompt_ids)
    return routed, prefill_BTLK[row, width - prompt_len : width - 1].clone()


def _num_experts(config: Any, num_routers: int) -> int:
    """Routed experts per layer from a transformers MoE config (Mixtral's key differs)."""
    for key in ("num_experts", "num_local_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{num_routers} MoE routers but no expert count in {type(config).__name__}")


# --- the engine ------------------------------------------------------------------------------


ParamSlice = tuple[torch.nn.Parameter, tuple]
"""A parameter and the index of the part of it one checkpoint tensor is."""


def checkpoint_views(params: dict[str, torch.nn.Parameter], config: Any) -> dict[str, ParamSlice]:
    """Checkpoint name -> (parameter, index) for tensors transformers holds fused in memory.

    transformers 5 keeps a mixture-of-experts layer's experts as two stacked parameters,
    ``mlp.experts.gate_up_proj`` ``[E, 2F, H]`` (each expert's gate rows, then its up rows) and
    ``mlp.experts.down_proj`` ``[E, H, F]``, while checkpoints, vLLM and the exporter name one
    tensor per expert (Mixtral also under ``block_sparse_moe``). ``param[index]`` is a view a
    weight sync writes in place (taken at use: sleeping swaps the parameter's storage). Dense
    models have none.
    """
    from megarl.models.mapping import MOE_HF_NAMES
    from megarl.models.spec import spec_from_hf_config

    if getattr(config, "model_type", None) not in MOE_HF_NAMES:
        return {}
    spec = spec_from_hf_config(config)
    module, (gate, up, down) = MOE_HF_NAMES[spec.family]
    f = spec.moe_ffn_hidden_size
    views: dict[str, ParamSlice] = {}
    for layer in range(spec.num_layers):
        mem, disk = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.{module}."
        router = params[mem + "gate.weight"]
        views[disk + "gate.weight"] = (router, ())
        gate_up, down_proj = params[mem + "experts.gate_up_proj"], params[mem + "experts.down_proj"]
        for e in range(spec.num_experts):
            expert = f"{disk}experts.{e}."
            views[expert + f"{gate}.weight"] = (gate_up, (e, slice(0, f)))
            views[expert + f"{up}.weight"] = (gate_up, (e, slice(f, 2 * f)))
            views[expert + f"{down}.weight"] = (down_proj, (e,))
    return views


@dataclass(frozen=True)
class _FreedParam:
    """What a parameter looked like before ``sleep(2)`` emptied it."""

    param: torch.nn.Parameter
    shape: torch.Size
    dtype: torch.dtype


class HFEngine(RolloutEngine):
    """Rollouts from a ``transformers`` causal LM, on CPU or one accelerator."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        device: str | torch.device = "cpu",
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        super().__init__()
        self._device = torch.device(device)
        # transformers' decorated ``PreTrainedModel.to`` is mistyped in its stubs
        moved = model.to(self._device)  # pyright: ignore[reportArgumentType]
        self._model = moved.eval().requires_grad_(False)
        self._eos_token_ids = resolve_eos_token_ids(eos_token_ids, tokenizer, model)
        self._pad_token_id = resolve_pad_token_id(pad_token_id, tokenizer, self._eos_token_ids)
        # Captured before any LoRA wrapping renames modules; tied names map to one Parameter.
        self._params_by_name: dict[str, torch.nn.Parameter] = dict(
            model.named_parameters(remove_duplicate=False)
        )
        self._checkpoint_views = checkpoint_views(self._params_by_name, model.config)
        routers = find_hf_routers(self._model)
        self._router_tap = (
            RouterTap(routers, _num_experts(model.config, len(routers))) if routers else None
        )
        self._freed: list[_FreedParam] = []
        self._adapter_loaded = False
        self._adapter_layout: tuple | None = None

    # -- properties --

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        embeddings = self._model.get_input_embeddings()
        if not isinstance(embeddings, torch.nn.Embedding):
            raise TypeError(f"input embeddings are a {type(embeddings).__name__}, not an Embedding")
        return embeddings.num_embeddings

    @property
    def model(self) -> PreTrainedModel:
        """The wrapped model (with any LoRA layers injected), for inspection and tests."""
        return self._model

    @property
    def device(self) -> torch.device:
        return self._device

    # -- generate --

    def _generate(self, call: GenerateCall) -> list[Generation]:
        """Samples at least one token per request before it looks at ``call.interrupt``: the
        event is polled once after each decode step's draw, so every call makes progress and an
        interrupted response never comes back empty."""
        responses = [ResponseState.start(request, call.params) for request in call.requests]
        tap = self._router_tap
        with tap.attached() if tap is not None else contextlib.nullcontext():
            routing = self._decode(responses, call)
        return [
            response.generation(*row_routing(response, row, routing))
            for row, response in enumerate(responses)
        ]

    @torch.inference_mode()
    def _decode(
        self, responses: list[ResponseState], call: GenerateCall
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode loop: fills ``responses`` until each has ended or the call is interrupted.

        The batch holds only the rows still going: a step that ends rows drops them from the
        cache before the next forward. Returns, for a mixture-of-experts model, the prefill's
        ``[B, T, layers, top_k]`` experts of every (left-padded) context column and the
        ``[B, S, layers, top_k]`` experts of each step's forward, zero after a row ended (None
        for a dense model)."""
        cache, logits_BV, attention_mask_BT, next_position_B, prefill_BTLK = self._prefill(
            DistinctContexts.of([response.request for response in responses])
        )
        tap = self._router_tap
        rows = list(range(len(responses)))  # the response of each of the cache's rows
        routes: list[tuple[list[int], torch.Tensor]] = []
        generator = torch.Generator()  # on the host: see sample_step
        while True:
            if tap is not None and prefill_BTLK is not None:  # the forward sampled from next
                routes.append((rows, tap.last_column(len(rows)) if routes else prefill_BTLK[:, -1]))
            token_L = sample_step(
                [responses[row] for row in rows],
                logits_BV,
                call.params,
                generator,
                self._eos_token_ids,
            )
            going = [i for i, row in enumerate(rows) if not responses[row].ended]
            if not going or call.interrupted:
                break
            if len(going) < len(rows):
                keep_L = torch.tensor(going, device=self._device)
                cache.batch_select_indices(keep_L)
                attention_mask_BT, next_position_B = (
                    attention_mask_BT[keep_L],
                    next_position_B[keep_L],
                )
                token_L, rows = token_L[keep_L], [rows[i] for i in going]
            attention_mask_BT = torch.cat(
                [attention_mask_BT, attention_mask_BT.new_ones((len(rows), 1))], dim=1
            )
            logits_BV = self._forward_last(
                token_L.unsqueeze(1), attention_mask_BT, next_position_B.unsqueeze(1), cache
            )
            next_position_B = next_position_B + 1
        if prefill_BTLK is None:
            return None
        routing_BSLK = prefill_BTLK.new_zeros(
            (len(responses), len(routes), *prefill_BTLK.shape[2:])
        )
        for step, (step_rows, experts_LLK) in enumerate(routes):
            routing_BSLK[step_rows, step] = experts_LLK
        return prefill_BTLK, routing_BSLK

    def _prefill(
        self, prefill: DistinctContexts
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run each distinct context through the model once and give every request's row its
        copy: the cache, logits and masks are indexed out to one row per request. Returns the
        cache, the ``[B, V]`` next-token logits, the ``[B, T]`` attention mask, the ``[B]`` next
        positions and, for a mixture-of-experts model, the ``[B, T, layers, top_k]`` experts of
        every column."""
        from transformers import DynamicCache

        batch = left_pad(prefill.contexts, self._pad_token_id, self._device)
        cache = DynamicCache(config=self._model.config)
        logits_UV = self._forward_last(
            batch.input_ids_BT, batch.attention_mask_BT, batch.position_ids_BT, cache
        )
        tap = self._router_tap
        prefill_UTLK = tap.columns(len(prefill.contexts)) if tap is not None else None
        next_position_U = batch.position_ids_BT[:, -1] + 1
        if not prefill.shared:  # no copy
            return cache, logits_UV, batch.attention_mask_BT, next_position_U, prefill_UTLK
        rows_B = torch.tensor(prefill.rows, device=self._device)
        cache.batch_select_indices(rows_B)
        prefill_BTLK = prefill_UTLK[rows_B.cpu()] if prefill_UTLK is not None else None
        mask_BT = batch.attention_mask_BT[rows_B]
        return cache, logits_UV[rows_B], mask_BT, next_position_U[rows_B], prefill_BTLK

    def _forward_last(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """Run new tokens through the model, extending ``cache``; logits of the last column."""
        output = self._model(
            input_ids=input_ids_BT,
            attention_mask=attention_mask_BT,
            position_ids=position_ids_BT,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1, :]

    # -- weights --

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], record_checksums: bool = False
    ) -> int:
        """Copies into the model's own parameters, so checksums are read from them on demand."""
        self._sleep.require_awake("update_weights")
        num_applied = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target, param = self._target_for(name, tensor)
                target.copy_(tensor)
                self._sleep.mark_reloaded([id(param)])
                num_applied += 1
        return num_applied

    def scale_weight(self, name: str, factor: float) -> None:
        with torch.no_grad():
            self._params_by_name[name].mul_(factor)

    def weight_checksums(self, dtype: torch.dtype) -> dict[str, tuple[int, int]]:
        """Per checkpoint name: a fused expert tensor is checked as the per-expert tensors the
        exporter sends."""
        fused = {id(param) for param, _ in self._checkpoint_views.values()}
        named: dict[str, torch.Tensor] = {
            n: p for n, p in self._params_by_name.items() if id(p) not in fused
        }
        named.update((n, param[index]) for n, (param, index) in self._checkpoint_views.items())
        return {name: tensor_checksum(t.detach().to(dtype)) for name, t in named.items()}

    def _target_for(
        self, name: str, tensor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.nn.Parameter]:
        """The tensor ``name`` writes into (a parameter, or a view of a fused expert parameter)
        and the parameter it belongs to, checked against ``tensor``'s shape."""
        if name in self._checkpoint_views:
            param, index = self._checkpoint_views[name]
            target = param[index]
        else:
            param = self._params_by_name.get(name)
            if param is None:
                raise ValueError(
                    f"unknown parameter name {name!r} for {type(self._model).__name__}"
                )
            target = param
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"parameter {name!r} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        return target, param

    def load_lora_adapter(self, adapter: LoraAdapter) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        self._sleep.require_awake("load_lora_adapter")
        if self._adapter_loaded and self._adapter_layout == adapter.layout:
            with torch.no_grad():  # adapter-only update: same layers, new values
                _copy_lora_tensors(self._model, adapter.named_tensors.items())
            return
        self.unload_lora_adapter()
        config = LoraConfig(
            r=adapter.rank,
            # peft says int; floats work
            lora_alpha=adapter.alpha,  # pyright: ignore[reportArgumentType]
            target_modules=list(adapter.target_modules),
            lora_dropout=0.0,
        )
        with warnings.catch_warnings():  # peft asks a deprecated transformers property
            warnings.filterwarnings("ignore", ".*is_gradient_checkpointing", FutureWarning)
            inject_adapter_in_model(config, self._model, adapter_name=ADAPTER_NAME)
        self._model.eval().requires_grad_(False)
        try:
            with torch.no_grad():
                _copy_lora_tensors(self._model, adapter.named_tensors.items())
        except BaseException:
            remove_lora_layers(self._model)
            raise
        self._adapter_loaded = True
        self._adapter_layout = adapter.layout

    def unload_lora_adapter(self) -> None:
        """Drop the current adapter, if any, so ``generate`` uses the base weights alone."""
        if self._adapter_loaded:
            remove_lora_layers(self._model)
            self._adapter_loaded = False

    # -- memory --

    def sleep(self, level: int) -> None:
        base_params = self._unique_base_params()
        self._sleep.fall_asleep(level, freed=[id(p) for p in base_params])
        if level == 1:
            self._move_params(torch.device("cpu"))
        else:
            self.unload_lora_adapter()
            self._free_base_params(base_params)
        self._release_cached_memory()

    def wake_up(self) -> EngineMemoryState:
        previous_level = self._sleep.wake()
        if previous_level == 1:
            self._move_params(self._device)
        elif previous_level == 2:
            self._reallocate_base_params()
        return self.memory_state()

    def memory_state(self) -> EngineMemoryState:
        return EngineMemoryState(
            base_weights_resident=self._sleep.base_weights_resident,
            adapter_resident=self._adapter_loaded,
        )

    def _unique_base_params(self) -> list[torch.nn.Parameter]:
        return list({id(p): p for p in self._params_by_name.values()}.values())

    def _move_params(self, device: torch.device) -> None:
        """Move all parameters (adapter included) without touching their identity."""
        if self._device.type == "cpu":
            return  # host memory is where the weights would go anyway
        with torch.no_grad():
            for param in self._model.parameters():
                param.data = param.data.to(device)

    def _free_base_params(self, params: list[torch.nn.Parameter]) -> None:
        """Swap each base parameter's storage for an empty tensor, remembering its layout."""
        self._freed = []
        for param in params:
            self._freed.append(_FreedParam(param, param.shape, param.dtype))
            param.data = torch.empty(0, dtype=param.dtype, device=self._device)

    def _reallocate_base_params(self) -> None:
        """Give freed parameters uninitialised storage of their old shape, to be resent."""
        for freed in self._freed:
            freed.param.data = torch.empty(freed.shape, dtype=freed.dtype, device=self._device)
        self._freed = []

    def _release_cached_memory(self) -> None:
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
