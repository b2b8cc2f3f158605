"""Load an HF checkpoint directory into our model modules (no download, ever)."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from safetensors import safe_open
from transformers import AutoConfig

from actors.engine import compressed_tensors, fp8, mxfp4, wna16
from actors.engine.models import get_model_class
from actors.engine.models.moe import ExpertList, StackedExperts
from actors.engine.parallel import SINGLE, ParamShard, TPGroup
from actors.engine.pipeline import PPMissingLayer

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's --weight-version default
# config.json fields that may differ between checkpoints of one model: they change nothing it computes
METADATA_FIELDS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"})
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# RoPE types whose max_position_embeddings is the scaled context already (vLLM's _get_and_verify_max_len)
ROPE_TYPES_SCALED_ALREADY = ("su", "longrope", "llama3")


def load_config(model_path: str):
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"model_path={model_path!r} has no config.json (only local checkpoints are served)")
    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def get_context_length(config) -> int:
    """The context a checkpoint serves, by vLLM's rule (``_get_and_verify_max_len``): its
    ``max_position_embeddings`` times its RoPE scaling's ``factor``, a YaRN factor over its
    ``original_max_position_embeddings`` (Qwen3's 40960 with a YaRN factor of 4 over 32768 serves
    131072, as vLLM's ``max_model_len``), where the rope type's length is not the scaled one
    already (Llama 3.1's, LongRoPE's; Gemma 3's). The same rule for the target and a draft: a
    draft held to its unscaled length stops drafting where it still could."""
    config = config.get_text_config()  # (a vision-language model's context is its decoder's)
    length = config.max_position_embeddings
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if "gemma3" in config.model_type or rope_type in ROPE_TYPES_SCALED_ALREADY:
        return length
    if rope_type == "yarn":
        length = params["original_max_position_embeddings"]
    return int(length * (params.get("factor") or 1.0))


def checkpoint_files(model_path: str) -> List[str]:
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path!r}")
    return files


def resolve_dtype(config, dtype: str) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return name if isinstance(name, torch.dtype) else DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def build_model(config, tp: TPGroup = SINGLE, model_cls: Optional[type] = None) -> torch.nn.Module:
    """The model's modules on the meta device (no memory): checks that ``tp``
    can shard it — a head or intermediate count it does not divide raises
    ValueError naming the config field. ``model_cls``: the class serving the checkpoint
    (:func:`served_model_class`; a served model's own, to build its like); its architecture's by default."""
    with torch.device("meta"):
        return (model_cls or architecture_class(config))(config, tp=tp)


def architecture_class(config) -> type:
    """The model class of HF ``config``'s architecture (its first ``architectures``)."""
    return get_model_class((getattr(config, "architectures", None) or ["?"])[0])


def served_model_class(model_path: str, config) -> type:
    """The class serving the checkpoint in ``model_path``: its architecture's, or the one that class's
    ``for_checkpoint`` picks by the checkpoint's tensor names (served names), where the architecture's
    checkpoints store a part in two layouts (Qwen3-VL-MoE's experts: stacked, or per expert)."""
    model_cls = architecture_class(config)
    if not hasattr(model_cls, "for_checkpoint"):
        return model_cls
    return model_cls.for_checkpoint(checkpoint_shapes(checkpoint_files(model_path),
                                                      getattr(model_cls, "checkpoint_renames", ())))


def checkpoint_shapes(files: List[str], renames=()) -> Dict[str, List[int]]:
    """Every tensor's shape in the checkpoint ``files`` (their headers only), by its served name
    (:func:`served_name` of the model's ``renames``)."""
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            shapes.update((served_name(renames, name), list(f.get_slice(name).get_shape())) for name in f.keys())
    return shapes


def served_name(renames, name: str) -> str:
    """Checkpoint tensor ``name`` as the served model calls it: the first of the model's
    ``checkpoint_renames`` ((prefix, served prefix) pairs) it starts with applied. A vision-language
    model's: transformers (4.52 on) names its decoder ``model.language_model.*`` and its vision tower
    ``model.visual.*`` (a trainer's ``named_parameters``, a checkpoint it saved) where the released
    checkpoints (and the served model) have ``model.*`` and ``visual.*``; vLLM and SGLang take both."""
    for prefix, served in renames:
        if name.startswith(prefix):
            return served + name[len(prefix):]
    return name


class _RenamedTensor(NamedTuple):
    """An open checkpoint file read as a file of one tensor, under its served name (:func:`open_checkpoint`),
    ``transposed`` where it is stored with its last two dims swapped (:func:`stored_transposed`)."""

    file: object
    name: str  # its name in the file
    transposed: bool = False

    def get_tensor(self, _served: str) -> torch.Tensor:
        tensor = self.file.get_tensor(self.name)
        return tensor.transpose(-1, -2) if self.transposed else tensor

    def get_slice(self, _served: str):
        view = self.file.get_slice(self.name)
        return _TransposedSlice(view) if self.transposed else view


class _TransposedSlice(NamedTuple):
    """A safetensors slice of a 3-D tensor read with its last two dims swapped (indexed by whole dims)."""

    view: object

    def get_shape(self) -> List[int]:
        *outer, rows, cols = self.view.get_shape()
        return [*outer, cols, rows]

    def __getitem__(self, index) -> torch.Tensor:
        index = (index if isinstance(index, tuple) else (index,)) + (slice(None),) * 3
        return self.view[index[0], index[2], index[1]].transpose(-1, -2)


def stored_transposed(model: torch.nn.Module, released: bool = False) -> Callable[[str, Sequence[int]], bool]:
    """Whether a checkpoint tensor (its served name, its shape) is one of a :class:`StackedExperts`' matrices
    stored [experts, in, out] (a released Qwen3-VL-MoE checkpoint's), where the model holds them [experts, out,
    in] (transformers 5's): the loader reads it transposed. ``released``: the checkpoint was saved by
    transformers before 5 (:func:`saved_before_transformers_5`), which tells a square matrix's layout."""
    stacked = {name: module for name, module in model.named_modules() if isinstance(module, StackedExperts)}

    def transposed(name: str, shape: Sequence[int]) -> bool:
        module_name, _, param = name.rpartition(".")
        return module_name in stacked and stacked[module_name].stored_transposed(param, shape, released)
    return transposed


def saved_before_transformers_5(config) -> bool:
    """Whether a checkpoint's config.json says transformers before 5 saved it (its ``transformers_version``;
    none recorded: taken as 5's), which stored :class:`StackedExperts`' matrices [experts, in, out]."""
    major = str(getattr(config, "transformers_version", None) or "").split(".")[0]
    return major.isdigit() and int(major) < 5


def open_checkpoint(stack: contextlib.ExitStack, files: List[str], renames=(),
                    transposed: Callable[[str, Sequence[int]], bool] = lambda name, shape: False) -> Dict[str, object]:
    """Each tensor of the checkpoint ``files`` (opened on ``stack``) by its served name (:func:`served_name`)
    → the open file to read it from (as named; ``transposed`` (served name, shape): stored transposed)."""
    files_of = {}
    for path in files:
        f = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
        for name in f.keys():
            served = served_name(renames, name)
            flip = transposed(served, f.get_slice(name).get_shape())
            files_of[served] = f if served == name and not flip else _RenamedTensor(f, name, flip)
    return files_of


class ServedModel(NamedTuple):
    """A model on meta with its quantized layers (each dict empty but for the checkpoint's quantization):
    block-FP8 weights' names → their layers, packed GPTQ / AWQ layers' names → the layers, and
    compressed-tensors (or per-tensor FP8) layers' names → the layers."""

    model: torch.nn.Module
    quantized: Dict[str, torch.nn.Module]
    packed: Dict[str, torch.nn.Module]
    compressed: Dict[str, torch.nn.Module]


def build_served_model(model_path: str, config, quantization: Optional[str] = None,
                       tp: TPGroup = SINGLE) -> ServedModel:
    """:func:`build_model`, its linear layers block FP8 where the checkpoint's are (or, with
    ``quantization="fp8"``, every one: :mod:`.fp8`), packed GPTQ / AWQ ints (:mod:`.wna16`) or
    compressed-tensors' (:mod:`.compressed_tensors`) where the checkpoint's are. ValueError for a
    quantization not served or a TP shard that cuts a block, a word or a group."""
    model = build_model(config, tp, served_model_class(model_path, config))
    refuse_quantized_stacked_experts(model, config, quantization)

    def shapes() -> Dict[str, List[int]]:  # (read for a quantized checkpoint only; by the modules' names)
        return checkpoint_shapes(checkpoint_files(model_path), getattr(model, "checkpoint_renames", ()))

    packed = wna16.resolve(config, quantization)
    if packed is not None:
        return ServedModel(model, {}, wna16.quantize_linears(model, packed, shapes()), {})
    compressed = compressed_tensors.resolve(config, quantization)
    if compressed is not None:
        return ServedModel(model, {}, {}, compressed_tensors.quantize_linears(model, compressed, shapes()))
    quant = fp8.resolve(config, quantization)
    if quant is None:
        return ServedModel(model, {}, {}, {})
    return ServedModel(model, fp8.quantize_linears(model, quant, shapes()), {}, {})


def refuse_quantized_stacked_experts(model: torch.nn.Module, config, quantization: Optional[str]) -> None:
    """ValueError naming the format for a quantized checkpoint, or ``quantization="fp8"``, of a model whose experts
    are held stacked (:class:`StackedExperts`: a Qwen3-VL-MoE checkpoint storing them so): they hold the model's
    dtype only, so a quantized checkpoint's stacked experts would fail the load as missing and unexpected tensors,
    and quantizing as it loads would leave them, most of the weights, unquantized. A checkpoint storing its
    experts per expert (the quantized releases') is served by per-expert layers (:func:`served_model_class`)."""
    stacked = next((name for name, module in model.named_modules() if isinstance(module, StackedExperts)), None)
    method = (fp8.quantization_config(config) or {}).get("quant_method")
    if stacked is None or (method is None and quantization is None):
        return
    what = f"quantization_config.quant_method={method!r}" if method else f"quantization={quantization!r}"
    raise ValueError(f"{what} is not served for {type(model).__name__}: its experts ({stacked}, ...) are stacked "
                     "3-D tensors served unquantized only; serve its unquantized (bf16) checkpoint, or one storing its "
                     "experts per expert (mlp.experts.{e}.gate_proj...)")


def load_model(
    model_path: str, dtype: str, device: str, tp: TPGroup = SINGLE, quantization: Optional[str] = None
) -> Tuple[torch.nn.Module, object, torch.dtype]:
    """Model in eval mode on ``device`` with every checkpoint tensor loaded
    (under TP, only this rank's shard of each is read). ``quantization``: ``EngineConfig``'s."""
    config = load_config(model_path)
    torch_dtype = resolve_dtype(config, dtype)
    model, quantized, packed, compressed = build_served_model(model_path, config, quantization, tp)
    model = model.to_empty(device=device)
    model.quantized_weights, model.packed_linears, model.compressed_linears = quantized, packed, compressed
    missing, unexpected = load_weights(model, checkpoint_files(model_path), saved_before_transformers_5(config))
    activations = compressed_tensors.quantized_activations(config) if compressed else []
    if activations:
        logger.warning("quantization_config quantizes the activations too (%s), but they are served weight-only: "
                       "each weight dequantized to the model's dtype, the activations unquantized (vLLM and SGLang "
                       "quantize them for W8A8 GEMMs)", ", ".join(activations))
    kv_scales = [name for name in unexpected if KV_CACHE_SCALE.search(name)]
    if kv_scales:
        logger.warning("the checkpoint's %d KV-cache scales (%s, ...) are unread: the KV cache is kv_cache_dtype's, "
                       "unscaled", len(kv_scales), kv_scales[0])
    unexpected = [name for name in unexpected if not ignored_weight(model, name)]
    if getattr(config, "tie_word_embeddings", False):
        missing = [m for m in missing if m != "lm_head.weight"]
        if not isinstance(model.lm_head, PPMissingLayer):  # (a pipeline stage before the last has none)
            model.lm_head.weight = model.model.embed_tokens.weight
    if missing or unexpected:
        raise ValueError(f"checkpoint/model mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model = cast_model(model, torch_dtype).eval()
    model.model.hidden_dtype = torch_dtype
    reinit_buffers(model)
    return model, config, torch_dtype


# an FP8 KV cache's scales (AutoFP8's kv_scale, llm-compressor's kv_cache_scheme k_scale / v_scale, ModelOpt's
# k_proj.k_scale, older compressed-tensors' k_proj / v_proj output_scale): the KV cache is kv_cache_dtype's,
# unscaled, so they are unread, logged once a load (vLLM's maybe_remap_kv_scale_name skips them so, with a
# warning, where its attention has no place for them)
KV_CACHE_SCALE = re.compile(r"\.(k|v|kv)_scale$|\.[kv]_proj\.output_scale$")
# tensors of a checkpoint that no served model computes with (HF skips them too)
IGNORED_WEIGHTS = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"), KV_CACHE_SCALE)  # (older checkpoints saved inv_freq)


def ignored_weight(model: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is a checkpoint tensor to skip: a saved ``inv_freq`` or KV-cache scale, the ``g_idx`` of
    a GPTQ layer without act-order or the bias of a packed layer without one (GPTQ-for-LLaMa stored zeros:
    :func:`wna16.unread`), a compressed-tensors layer's ``weight_shape`` or ``input_scale``
    (:func:`compressed_tensors.unread`), or one the model class skips by its ``ignored_weight(name)``
    (multi-token-prediction layers)."""
    if (any(p.search(name) for p in IGNORED_WEIGHTS) or wna16.unread(getattr(model, "packed_linears", {}), name)
            or compressed_tensors.unread(getattr(model, "compressed_linears", {}), name)):
        return True
    return bool(getattr(model, "ignored_weight", lambda _: False)(name))


def _read(f, name: str, shard: Optional[ParamShard]) -> torch.Tensor:
    """The whole tensor, or only the rows / columns of ``shard`` (read lazily; with
    ``zero_fill``, zeros for the part of a range past the tensor's end)."""
    if shard is None:
        return f.get_tensor(name)
    view = f.get_slice(name)
    return torch.cat([_read_range(view, shard, r) for r in shard.ranges], dim=shard.dim)


def _read_range(view, shard: ParamShard, r: range) -> torch.Tensor:
    dim, stop = shard.dim, r.stop
    if shard.zero_fill:  # [start, stop) read, [stop, r.stop) the vocabulary's padding
        stop = min(r.stop, view.get_shape()[dim])
    start = min(r.start, stop)
    part = view[(slice(None),) * dim + (slice(start, stop),)]
    if stop - start == len(r):
        return part
    pad = list(part.shape)
    pad[dim] = len(r) - (stop - start)
    return torch.cat([part, part.new_zeros(pad)], dim=dim)


def checkpoint_targets(model: torch.nn.Module) -> Dict[str, Tuple[torch.Tensor, Optional[ParamShard]]]:
    """Each checkpoint tensor name → the model tensor it is copied into and this rank's shard of
    it (None: the whole tensor). Taken before anything wraps the modules (LoRA), it still names
    the very tensors the model computes with: a weight update copies into them in place."""
    targets = {}
    for name, target in model.state_dict(keep_vars=True).items():
        module_name, _, param_name = name.rpartition(".")
        targets[name] = target, getattr(model.get_submodule(module_name), "param_shards", {}).get(param_name)
    return targets


def copy_tensor(f, name: str, target: torch.Tensor, shard: Optional[ParamShard],
                quantized: Optional[torch.nn.Module] = None) -> List[str]:
    """Checkpoint tensor ``name`` of the open file ``f`` (this rank's ``shard``) into ``target``; the
    weight of ``quantized``, a block-FP8 layer, through :func:`fp8.copy_weight`. The names written."""
    tensor = _read(f, name, shard)
    if tensor.shape != target.shape:
        raise ValueError(f"{name}: checkpoint shard {tuple(tensor.shape)} != model {tuple(target.shape)}")
    if quantized is not None:
        prefix = name.removesuffix("weight")
        return [prefix + param for param in fp8.copy_weight(quantized, tensor)]
    with torch.no_grad():
        target.copy_(tensor)
    return [name]


def load_weights(model: torch.nn.Module, files: List[str], released: bool = False) -> Tuple[List[str], List[str]]:
    """Copy every checkpoint tensor into the model (by HF name); returns the
    (missing, unexpected) names. A parameter ``X`` stored in MXFP4 (``X_blocks`` and
    ``X_scales``, in any of the files) is dequantized into it (:mod:`.mxfp4`); the model's
    ``quantized_weights`` (:func:`build_served_model`) load as block FP8. ``released``: saved by
    transformers before 5 (:func:`stored_transposed`)."""
    targets, quantized = checkpoint_targets(model), getattr(model, "quantized_weights", {})
    elsewhere = held_elsewhere(model)
    loaded, unexpected = set(), []
    with contextlib.ExitStack() as stack:
        files_of = open_checkpoint(stack, files, getattr(model, "checkpoint_renames", ()),
                                   stored_transposed(model, released))
        for name, f in files_of.items():
            packed = mxfp4.packed_name(name)
            if packed in targets:
                if name.endswith("_blocks"):
                    _load_mxfp4(packed, *targets[packed], f, files_of)
                    loaded.add(packed)
                continue
            if name not in targets:
                if not elsewhere(name):  # (EP: another rank's expert, left unread)
                    unexpected.append(name)
                continue
            loaded.update(copy_tensor(f, name, *targets[name], quantized.get(name)))
    return [n for n in targets if n not in loaded], unexpected


# a checkpoint tensor of one expert of a layer's ExpertList: (the list's module name, the expert)
EXPERT_TENSOR = re.compile(r"^(.+\.experts)\.(\d+)\.")


def held_elsewhere(model: torch.nn.Module):
    """Whether a checkpoint tensor name is of an expert another rank holds (EP: an ExpertList's
    ``held`` leaves it out) or of a module another pipeline stage holds (a ``PPMissingLayer``), so
    that this rank neither reads it nor counts it unexpected."""
    held = {name: module.held for name, module in model.named_modules() if isinstance(module, ExpertList)}
    other_stages = tuple(name + "." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))

    def elsewhere(name: str) -> bool:
        if name.startswith(other_stages):
            return True
        match = EXPERT_TENSOR.match(name)
        return bool(match) and match[1] in held and int(match[2]) not in held[match[1]]
    return elsewhere


def _load_mxfp4(name: str, target: torch.Tensor, shard: Optional[ParamShard], f, files_of: dict) -> None:
    """MXFP4 ``name`` [experts, in, out] dequantized into ``target``, an expert at a time (a large
    model's whole layer would take gigabytes at once), this rank's shard: its experts under EP (a
    shard of dim 0), its slice of each expert under TP."""
    if name + "_scales" not in files_of:
        raise ValueError(f"{name}_blocks has no {name}_scales in the checkpoint")
    blocks, scales = f.get_slice(name + "_blocks"), files_of[name + "_scales"].get_slice(name + "_scales")
    by_expert = shard is not None and shard.dim == 0
    experts = [e for r in shard.ranges for e in r] if by_expert else range(target.shape[0])
    for i, e in enumerate(experts):
        weight = mxfp4.dequantize(blocks[e], scales[e], target.dtype)
        if shard is not None and not by_expert:  # (a dim of the expert's slice: one less than the whole tensor's)
            weight = torch.cat([weight.narrow(shard.dim - 1, r.start, len(r)) for r in shard.ranges], shard.dim - 1)
        if weight.shape != target.shape[1:]:
            raise ValueError(f"{name}: dequantized expert shard {tuple(weight.shape)} != model "
                             f"{tuple(target.shape[1:])}")
        with torch.no_grad():
            target[i].copy_(weight)


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype``, except the buffers its class names in ``fp32_buffers``: HF
    keeps those in fp32 whatever the model dtype (DeepSeek's routing bias), and so must we;
    block-FP8 weights and their scales, packed GPTQ / AWQ layers' scales and compressed-tensors layers' FP8
    weights and scales stay as they are."""
    keep = set(getattr(model, "fp32_buffers", ()))
    kept = {name: buf.float() for name, buf in model.named_buffers() if name.rpartition(".")[2] in keep}
    quantized = {id(p) for p in fp8.quantized_params(getattr(model, "quantized_weights", {}))
                 + wna16.packed_params(getattr(model, "packed_linears", {}))
                 + compressed_tensors.compressed_params(getattr(model, "compressed_linears", {}))}
    # (model.to(dtype), but for them: never a cast copy of a whole FP8 model at once)
    model = model._apply(lambda t: t.to(dtype) if t.is_floating_point() and id(t) not in quantized else t)
    for name, buf in kept.items():
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, buf)
    return model


def reinit_buffers(model: torch.nn.Module) -> None:
    """Non-persistent buffers (rotary inv_freq) were created on meta: rebuild them."""
    for module in model.modules():
        if hasattr(module, "rebuild_buffers"):
            module.rebuild_buffers()


class TensorFile:
    """Named tensors read as an open safetensors file is (``keys``, ``get_tensor``, ``get_slice``), so
    that a weight update from tensors takes each rank's shard through the checkpoint's reads."""

    def __init__(self, tensors: Dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> "TensorFile.Slice":
        return TensorFile.Slice(self.tensors[name])

    class Slice(NamedTuple):
        tensor: torch.Tensor

        def get_shape(self) -> List[int]:
            return list(self.tensor.shape)

        def __getitem__(self, index) -> torch.Tensor:
            return self.tensor[index]


# what a weight update reads: a checkpoint directory, or named tensors (HF names, whole tensors)
WeightsSource = Union[str, Dict[str, torch.Tensor]]


class ServedWeights:
    """The checkpoint tensors one rank serves: where they came from (``path``: None once tensors
    replaced some, as no checkpoint holds them), their version, and the model tensors (this rank's
    shards) each is copied into, taken before LoRA wraps the modules."""

    def __init__(self, model: torch.nn.Module, config, path: str):
        self.config, self.path, self.version = config, path, DEFAULT_WEIGHT_VERSION
        self.targets = checkpoint_targets(model)
        self.quantized = getattr(model, "quantized_weights", {})  # block-FP8 weights → their layers
        self.packed = getattr(model, "packed_linears", {})  # GPTQ / AWQ layers' names → the layers
        self.compressed = getattr(model, "compressed_linears", {})  # compressed-tensors layers' names → the layers
        self.elsewhere = held_elsewhere(model)  # (EP: the experts other ranks hold, and check)
        self.renames = getattr(model, "checkpoint_renames", ())  # (served_name)
        self.model_cls = type(model)  # (the class serving the checkpoint: its like builds the whole tensors)
        # (named tensors: as transformers 5 holds them; a checkpoint's: by who saved it, _stored_transposed)
        self.transposed, self.released_transposed = stored_transposed(model), stored_transposed(model, released=True)
        if getattr(config, "tie_word_embeddings", False):  # (the embedding's tensor: loaded by its own name)
            self.targets.pop("lm_head.weight", None)

    def check(self, source: WeightsSource) -> None:
        """ValueError naming what differs when ``source`` cannot replace the served weights: a
        checkpoint directory (config.json and the safetensors headers read), or named tensors (their
        shapes and dtypes read: tensors on meta check alike)."""
        self._served_names(self._renamed(source))

    def _renamed(self, source: WeightsSource) -> WeightsSource:
        """Named tensors by their served names (:func:`served_name`), those stored transposed transposed back
        (:func:`stored_transposed`: views); ValueError for a tensor named twice so (under both of its names); a
        checkpoint directory as it is (:func:`open_checkpoint` renames and transposes)."""
        if isinstance(source, str):
            return source
        renamed = {served_name(self.renames, name): tensor for name, tensor in source.items()}
        if len(renamed) != len(source):
            raise ValueError("tensors named twice (under two names of one served tensor): "
                             f"{sorted(set(source) - set(renamed))[:8]}")
        return {name: tensor.transpose(-1, -2) if self.transposed(name, tensor.shape) else tensor
                for name, tensor in renamed.items()}

    def _served_names(self, source: WeightsSource) -> List[str]:
        """(:meth:`check`) the served tensors ``source`` replaces: a checkpoint all of them, named
        tensors any of them (an RL trainer may send them in buckets). One stored in MXFP4 (``X_blocks``
        + ``X_scales``, as loaded at start) counts by the shape it dequantizes to; a block-FP8 layer's
        scales are served tensors too (but a checkpoint's when it is quantized as it loads). Under EP,
        this rank's experts only: another rank's are left to that rank's check (every rank checks
        before any copies)."""
        if isinstance(source, str):
            what, shapes = f"checkpoint {source!r}", self._checkpoint_shapes(source)
        else:
            what, shapes = "the named tensors", {name: list(t.shape) for name, t in source.items()}
        full = build_model(self.config, model_cls=self.model_cls)  # (on meta: the whole tensors' shapes, not shards)
        fp8.quantize_like(full, self.quantized)
        wna16.quantize_like(full, self.packed)
        compressed_tensors.quantize_like(full, self.compressed)
        full.packed_linears, full.compressed_linears = self.packed, self.compressed  # (ignored_weight reads them)
        expected = {name: list(t.shape) for name, t in full.state_dict().items() if name in self.targets}
        if isinstance(source, str) and getattr(self.config, "quantization_config", None) is None:  # (fp8 as they load)
            expected = {name: shape for name, shape in expected.items() if not name.endswith(fp8.SCALE)}
        shapes = mxfp4.unpacked_shapes(shapes, expected)
        problems = _checkpoint_problems(shapes, expected,
                                        lambda name: ignored_weight(full, name) or self.elsewhere(name),
                                        partial=not isinstance(source, str))
        if not isinstance(source, str):
            problems += (self._fp8_problems(source) + wna16.unread_problems(self.packed, source)
                         + compressed_tensors.stored_problems(self.compressed, source))
        if problems:
            raise ValueError(f"{what} {'does' if isinstance(source, str) else 'do'} not fit the served model: "
                             f"{'; '.join(problems)}")
        return [name for name in expected if name in shapes]

    def _checkpoint_shapes(self, path: str) -> Dict[str, List[int]]:
        """The tensor shapes of the checkpoint in ``path``; ValueError when its config differs from the
        served one's but for metadata."""
        try:
            config, files = load_config(path), checkpoint_files(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"checkpoint {path!r}: {exc}") from None
        served, new = self.config.to_dict(), config.to_dict()
        differ = [f"{k}={new.get(k)!r} (served {served.get(k)!r})" for k in sorted(set(served) | set(new))
                  if k not in METADATA_FIELDS and served.get(k) != new.get(k)]
        if differ:
            raise ValueError(f"checkpoint {path!r}: config.json differs from the served model's: {', '.join(differ)}")
        shapes = checkpoint_shapes(files, self.renames)
        transposed = self._stored_transposed(config)
        return {name: shape[:-2] + shape[:-3:-1] if transposed(name, shape) else shape
                for name, shape in shapes.items()}

    def _stored_transposed(self, config) -> Callable[[str, Sequence[int]], bool]:
        """:func:`stored_transposed` for a checkpoint of HF ``config``: its square matrices by who saved it."""
        return self.released_transposed if saved_before_transformers_5(config) else self.transposed

    def _fp8_problems(self, tensors: Dict[str, torch.Tensor]) -> List[str]:
        """Named tensors' FP8 rule: a block-FP8 layer's weight comes in FP8 with its ``weight_scale_inv``
        (both replaced), or in another dtype alone (quantized as it loads, its scales written); no
        layer served unquantized takes an FP8 tensor. A compressed-tensors layer's tensors come as it stores them
        (:func:`compressed_tensors.stored_problems`); those of a layer another rank holds (an expert under EP,
        another pipeline stage's) are its check's."""
        problems = []
        for name, tensor in tensors.items():
            if name.rpartition(".")[0] in self.compressed or self.elsewhere(name):
                continue
            weight = name.removesuffix(fp8.SCALE) + "weight"
            is_fp8 = tensor.dtype == fp8.FP8
            if name.endswith(fp8.SCALE) and getattr(tensors.get(weight), "dtype", None) != fp8.FP8:
                problems.append(f"{name} without its FP8 {weight}")
            elif is_fp8 and name not in self.quantized:
                problems.append(f"{name} is FP8 but its layer is not served in FP8")
            elif is_fp8 and name.removesuffix("weight") + fp8.SCALE not in tensors:
                problems.append(f"{name} is FP8 without its {name.removesuffix('weight') + fp8.SCALE}")
        return problems

    def load(self, source: WeightsSource) -> List[str]:
        """Copy ``source`` (checked again) into the served tensors, this rank's shards; returns their names."""
        source = self._renamed(source)
        names = self._served_names(source)
        with contextlib.ExitStack() as stack:
            if isinstance(source, str):
                files_of = open_checkpoint(stack, checkpoint_files(source), self.renames,
                                           self._stored_transposed(load_config(source)))
            else:
                files_of = dict.fromkeys(source, TensorFile(source))
            for name in names:
                if name in files_of:
                    copy_tensor(files_of[name], name, *self.targets[name], self.quantized.get(name))
                else:  # (MXFP4: _served_names found its blocks and scales)
                    _load_mxfp4(name, *self.targets[name], files_of[name + "_blocks"], files_of)
        self.path = source if isinstance(source, str) else None
        return names


def _checkpoint_problems(shapes: Dict[str, List[int]], expected: Dict[str, List[int]], ignored,
                         partial: bool = False) -> List[str]:
    """What keeps a checkpoint of tensors ``shapes`` from replacing the ``expected`` ones (names →
    shapes): missing tensors (but when ``partial``), other shapes, tensors the model has no place for
    (but ``ignored``)."""
    problems = []
    missing = [] if partial else [name for name in expected if name not in shapes]
    if missing:
        problems.append(f"missing tensors {missing[:8]}")
    wrong = [f"{name} {shapes[name]} (served {shape})" for name, shape in expected.items()
             if name in shapes and shapes[name] != shape]
    if wrong:
        problems.append(f"tensor shapes differ: {', '.join(wrong[:8])}")
    unexpected = [name for name in shapes  # (a tied model's lm_head.weight: its embedding serves)
                  if name not in expected and name != "lm_head.weight" and not ignored(name)]
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:8]}")
    return problems
