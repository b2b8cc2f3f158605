"""The decoder-only skeleton every model shares (HF parameter names).

``DecoderModel``: ``embed_tokens`` → each layer ``(positions, x, forward_batch)``
→ ``norm``; layers are built as ``layer_cls(config, layer_id, tp)``.
``CausalLM``: ``model`` + ``lm_head``, returning a :class:`LogitsOutput`: fp32
logits of each request's last token but an embedding request's (every token's in a verify batch), optionally
divided by ``logits_scaling`` (Granite) and soft-capped (after the vocabulary is whole, in the model's dtype
before the cast), and, for the positions a batch asks (``input_logprob_indices``), the input logprobs, and for
embedding requests (``embed_indices``) the final hidden states of their last tokens, with the logits of
just two tokens there for those that score (``classifier_token_ids``, see ``pooling``). Under TP
the embedding and ``lm_head`` are split by vocabulary (``parallel``'s
``VocabParallelEmbedding`` / ``ParallelLMHead``): every rank computes its
range of the logits and joins their all-gather; rank 0 returns the whole
vocabulary, the other ranks an empty tensor (they never sample); the hidden states are
whole on every rank (after the row-parallel all-reduce), rank 0 returns them; a score's two
logits are summed over the ranks' vocabulary ranges (one all-reduce of ``[n, 2]``). Under pipeline
parallelism (``tp.pp``, :mod:`..pipeline`) a stage builds only its layers (the others, the embedding
off the first stage and the norm and ``lm_head`` off the last, are ``PPMissingLayer``), takes its
input from the previous stage and hands its output on; the last stage's output reaches rank 0.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import nn

from actors.engine.models.spec import KVCacheSpec
from actors.engine.parallel import SINGLE, ParallelLMHead, TPGroup, VocabParallelEmbedding
from actors.engine.pipeline import PPMissingLayer


# fp32 logits computed at once for input logprobs, at most (rows × vocab): a long prompt's are taken in
# slices of rows, never its whole [prompt_len, vocab] (2**25 fp32: 128 MiB, 220 rows of a 152k vocabulary)
INPUT_LOGPROB_SLICE_ELEMENTS = 2 ** 25


class InputLogprobs(NamedTuple):
    """Input logprobs of the batch's ``input_logprob_indices`` rows (fp32, on the model's device):
    the logprob of the next token at each, its rank in the whole vocabulary (vLLM's prompt
    logprobs' ``rank``: 1 + the tokens more likely), and the ``input_top_logprobs_num`` most likely
    (values and ids, largest first; None when no request asks for them)."""

    token_logprobs: torch.Tensor  # [n]
    token_ranks: torch.Tensor  # [n] int64, 1 = the most likely
    top_values: Optional[torch.Tensor] = None  # [n, k]
    top_ids: Optional[torch.Tensor] = None  # [n, k]


class LogitsOutput(NamedTuple):
    """A forward's result (SGLang's ``LogitsProcessorOutput``); on TP ranks > 0 the logits are
    empty and there are no input logprobs (only rank 0 samples)."""

    # [bs, vocab] fp32, each request's last token but an embedding request's ([num_tokens, vocab]: verify)
    next_token_logits: torch.Tensor
    input_logprobs: Optional[InputLogprobs] = None
    embeddings: Optional[torch.Tensor] = None  # [len(embed_indices), hidden] fp32: their final-norm hidden states
    classifier_logits: Optional[torch.Tensor] = None  # [len(embed_indices), 2] fp32: classifier_token_ids' logits


class DecoderModel(nn.Module):
    def __init__(self, config, layer_cls: Callable, norm: nn.Module, embed_scale: Optional[float] = None,
                 tp: TPGroup = SINGLE):
        super().__init__()
        pp = tp.pp
        tied = getattr(config, "tie_word_embeddings", False)
        # (the last stage's lm_head is the tied embedding's weight)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
                             if pp.is_first or (pp.is_last and tied) else PPMissingLayer())
        self.stage_layers = pp.layers(config.num_hidden_layers)
        self.layers = nn.ModuleList(layer_cls(config, i, tp) if i in self.stage_layers else PPMissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = norm if pp.is_last else PPMissingLayer()
        self.tp = tp
        self.embed_scale = embed_scale
        self.hidden_size = config.hidden_size
        self.hidden_dtype = torch.get_default_dtype()  # the activations' (a later stage's input): the loader's dtype
        # the first decoder layers that add features the first stage computes (Qwen3-VL's DeepStack,
        # ``forward_batch.deepstack_embeds``): a later stage holding one takes them after the hidden states
        self.deepstack_layers = 0

    def forward(self, forward_batch, input_embeds: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The final-norm hidden states; None on a pipeline stage before the last (they went on).
        ``input_embeds``: the batch's input embeddings, when not those of its ``input_ids`` (a
        vision-language model's, images' rows in; read by the first stage only)."""
        pp = self.tp.pp
        if pp.is_first:
            x = self.embed_tokens(forward_batch.input_ids) if input_embeds is None else input_embeds
            # Gemma 3's normalizer, Granite's embedding_multiplier: cast to the model's dtype first, as HF's Gemma
            # (HF's Granite multiplies by the float: the same where it is exact in the dtype, as Granite's 12)
            if self.embed_scale is not None:
                x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        else:
            ids = forward_batch.input_ids
            x = pp.recv_hidden((ids.shape[0], self.hidden_size), self.hidden_dtype, ids.device)
            if self.stage_layers.start < self.deepstack_layers:
                forward_batch.deepstack_embeds = pp.recv_deepstack(self.hidden_size, self.hidden_dtype, ids.device)
        positions = forward_batch.rope_positions()
        for i in self.stage_layers:
            x = self.layers[i](positions, x, forward_batch)
        if not pp.is_last:
            pp.send_hidden(x)
            if self.stage_layers.stop < self.deepstack_layers:  # (the next stage starts at stop)
                pp.send_deepstack(forward_batch.deepstack_embeds, self.hidden_dtype, x.device)
            return None
        return self.norm(x)


# the projections of a decoder layer that take LoRA adapters (actors.engine.lora), HF's names under the layer
LORA_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LORA_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LORA_EXPERTS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")  # (every routed expert's)


# the KVCacheSpec fields that list global layer ids (a pipeline stage's spec keeps its layers')
LAYER_ID_FIELDS = ("full_attention_layer_ids", "swa_attention_layer_ids", "mamba_layer_ids")


class CausalLM(nn.Module):
    # the modules of each decoder layer that take LoRA adapters (a layer may lack some: Qwen3-MoE's dense MLP is on
    # its mlp_only_layers alone), a routed expert's without its index (mlp.experts.gate_proj: every expert's, as
    # vLLM's fused-MoE LoRA); none: the model serves no adapters. An adapter targeting another is refused, naming it
    supported_lora_modules: Tuple[str, ...] = ()
    # a fused projection -> the HF projections it stacks, in the order of its rows (SGLang's packed_modules_mapping):
    # lora_target_modules' names of the parts target it; an adapter's parts are stacked into one of it
    packed_modules_mapping: Dict[str, Tuple[str, ...]] = {}

    def __init__(self, config, model: DecoderModel, final_logit_softcap: Optional[float] = None,
                 logits_scaling: float = 1.0):
        super().__init__()
        self.config = config
        self.model = model
        if not model.tp.pp.is_last:
            self.lm_head = PPMissingLayer()
        else:
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, model.tp)
            if getattr(config, "tie_word_embeddings", False):
                self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcap = final_logit_softcap
        self.logits_scaling = logits_scaling  # Granite's: the logits divided by it

    def make_spec(self, **fields) -> KVCacheSpec:
        """This rank's :class:`KVCacheSpec` (its TP place filled in; under pipeline parallelism its
        stage's layers only: the full-attention, sliding-window and Mamba layer id lists cut to them,
        ``num_layers`` the stage's KV layers)."""
        tp = self.model.tp
        if tp.pp.size > 1:
            layers = self.model.stage_layers
            fields.update({key: [i for i in fields[key] if i in layers] for key in LAYER_ID_FIELDS if key in fields})
            # (a hybrid model's KV layers are its full-attention ones; the others' layers all hold KV)
            num_layers = len(fields["full_attention_layer_ids"]) if fields["kind"] == "hybrid_mamba" else len(layers)
            fields.update(num_layers=num_layers, start_layer=layers.start)
        return KVCacheSpec(tp_rank=tp.rank, tp_size=tp.size, pp_rank=tp.pp.rank, pp_size=tp.pp.size, **fields)

    def input_embeds(self, forward_batch) -> Optional[torch.Tensor]:
        """The batch's input embeddings when they are not its tokens' (a vision-language model's);
        None: the embedding lookup of ``input_ids``."""
        return None

    def forward(self, forward_batch) -> LogitsOutput:
        pp = self.model.tp.pp
        hidden = self.model(forward_batch, self.input_embeds(forward_batch) if pp.is_first else None)
        if hidden is None:  # a stage before the last: rank 0 takes the last stage's output (ModelRunner.recv_output)
            return LogitsOutput(forward_batch.input_ids.new_empty(0, dtype=torch.float32))
        index = forward_batch.logits_token_indices()
        if index.numel():
            logits = self._logits(hidden[index])
        else:  # a batch of embedding requests only: no lm_head (every TP rank sees the same batch)
            logits = hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        input_logprobs = self._input_logprobs(hidden, forward_batch)
        embed, classify = forward_batch.embed_indices, forward_batch.classifier_token_ids
        # (every rank: the all-reduce of the two tokens' logits)
        classifier_logits = None if classify is None else self._final(
            self.lm_head.token_logits(hidden[embed], classify)).float()
        if not self.model.tp.is_leader:  # TP: only rank 0 samples; the other ranks' forward ends here
            return LogitsOutput(logits.new_empty(0))
        # (only those rows: no [tokens, hidden] copy outlives the batch)
        output = LogitsOutput(logits, input_logprobs, None if embed is None else hidden[embed].float(),
                              classifier_logits)
        if pp.size > 1:  # the last stage's TP rank 0: rank 0 samples
            pp.send_output(output)
            return LogitsOutput(logits.new_empty(0))
        return output

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of ``hidden`` rows (every rank: one all-gather; rank 0's are the ones read)."""
        return self._final(self.lm_head(hidden)).float()

    def _final(self, logits: torch.Tensor) -> torch.Tensor:
        """``lm_head``'s logits divided by ``logits_scaling`` and soft-capped, in the model's dtype (as HF)."""
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        cap = self.final_logit_softcap
        if cap:  # in the model's dtype, as HF's Gemma and vLLM's logits processor; sampling is in fp32
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _input_logprobs(self, hidden: torch.Tensor, forward_batch) -> Optional[InputLogprobs]:
        """fp32 log-softmax of the logits at ``input_logprob_indices``, read at the next token of
        each, its rank (and its top ``input_top_logprobs_num``), slice by slice of rows
        (:data:`INPUT_LOGPROB_SLICE_ELEMENTS`); every TP rank runs the slices' all-gathers."""
        index = forward_batch.input_logprob_indices
        if index is None:
            return None
        rows, next_ids, k = hidden[index], forward_batch.input_logprob_next_ids, forward_batch.input_top_logprobs_num
        step = max(1, INPUT_LOGPROB_SLICE_ELEMENTS // self.config.vocab_size)
        chosen, ranks, top_values, top_ids = [], [], [], []
        for start in range(0, rows.shape[0], step):
            logits = self._logits(rows[start:start + step])
            if not self.model.tp.is_leader:  # (its part: the all-gather)
                continue
            logprobs = torch.log_softmax(logits, dim=-1)
            token = logprobs.gather(1, next_ids[start:start + step, None])
            chosen.append(token[:, 0])
            ranks.append((logprobs > token).sum(dim=-1) + 1)
            if k:
                top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
                top_values.append(top.values)
                top_ids.append(top.indices)
        if not self.model.tp.is_leader:
            return None
        if not k:
            return InputLogprobs(torch.cat(chosen), torch.cat(ranks))
        return InputLogprobs(torch.cat(chosen), torch.cat(ranks), torch.cat(top_values), torch.cat(top_ids))
