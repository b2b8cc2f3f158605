"""LoRA on a fused projection from adapters of its parts: PEFT trains an adapter on the projections of the HF
model it ran on, and an adapter of Llama-style ``q_proj`` / ``k_proj`` / ``v_proj`` (or ``gate_proj`` /
``up_proj``) meets Phi-3's fused ``qkv_proj`` (``gate_up_proj``). The parts' adapters are stacked into one
pair over the fused layer (vLLM's ``packed_modules_mapping`` slices, SGLang's stacked ``qkv_proj`` buffers):
A the present parts' A one after another, ``[parts·r, in]``, and B block-diagonal, ``[out, parts·r]``, each
part's B in its rows of the fused output and its own columns, zeros in the rows of a part it has none of —
so ``B A x`` is each part's ``Bₚ Aₚ x`` in its own rows, exactly. The fused layer's slots hold
``parts × max_lora_rank`` where a start adapter or ``lora_target_modules`` names a part of it, else
``max_lora_rank``, which a parts adapter loaded later must fit stacked (its parts' ranks summed;
:meth:`actors.engine.lora.LoRAManager._fused_taking_parts`), and under TP its B rows are cut by the layer's own
part ranges, as an adapter trained on the fused projection is.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
from torch import nn

Pair = Tuple[torch.Tensor, torch.Tensor]


def stack_packed(weights: Dict[str, Pair], rank: int, packed_modules: Dict[str, Tuple[str, ...]],
                 full_layer: Callable[[str], nn.Module]) -> Dict[str, Pair]:
    """``weights`` (module -> ``(A [r, in], B [out, r])``) with the parts of each fused projection of
    ``packed_modules`` (fused name -> its parts, in the order of its rows) stacked into one pair of the fused
    layer, ``full_layer(module)`` (unsharded: its weight's part ranges are the parts' rows; ValueError for a
    module the model has not). ValueError for a layer with an adapter of both the fused projection and a part,
    or a part whose shape does not fit its rows."""
    part_of = {part: fused for fused, parts in packed_modules.items() for part in parts}
    out: Dict[str, Pair] = {}
    stacks: Dict[str, Dict[str, Pair]] = {}  # fused module -> its parts' pairs
    for module, pair in weights.items():
        parent, _, leaf = module.rpartition(".")
        if leaf in part_of:
            stacks.setdefault(f"{parent}.{part_of[leaf]}", {})[leaf] = pair
        else:
            out[module] = pair
    for module, parts in stacks.items():
        names = packed_modules[module.rpartition(".")[2]]
        if module in out:
            raise ValueError(f"{module} has an adapter, and so do its parts {', '.join(sorted(parts))}")
        layer = full_layer(module)
        rows = layer.param_shards["weight"].ranges  # (unsharded: one range per part, in order)
        present = [name for name in names if name in parts]
        b = torch.zeros(layer.out_features, len(present) * rank, dtype=parts[present[0]][1].dtype)
        for i, name in enumerate(present):
            part_a, part_b = parts[name]
            part_rows = rows[names.index(name)]
            if part_a.shape[1] != layer.in_features or part_b.shape[0] != len(part_rows):
                raise ValueError(f"{module.rpartition('.')[0]}.{name} lora_A {tuple(part_a.shape)} and lora_B "
                                 f"{tuple(part_b.shape)} do not fit its rows of the fused {module} (want "
                                 f"({rank}, {layer.in_features}) and ({len(part_rows)}, {rank}))")
            b[part_rows.start:part_rows.stop, i * rank:(i + 1) * rank] = part_b
        out[module] = (torch.cat([parts[name][0] for name in present]), b)
    return out
