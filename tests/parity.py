"""The one parity helper: our greedy tokens against HF transformers' ``generate``.

At the first position where the two disagree, HF's logits there must be a
near-tie (our token's logit within ``tie_tol`` of HF's best); after a tie
the sequences may legitimately diverge, so comparison stops there. A
vision-language checkpoint's prompts come with their images: HF's image
processor gives its ``generate`` the pixels, each image's tokens the image token.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence

import torch


@lru_cache(maxsize=8)
def hf_model(model_path: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = hasattr(AutoConfig.from_pretrained(model_path, local_files_only=True), "vision_config")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(model_path, local_files_only=True, dtype=torch.float32).eval()


def hf_image_inputs(model_path: str, prompt: Sequence[int], images: Sequence, videos: Sequence = ()) -> dict:
    """HF's inputs of a vision-language ``prompt`` (one image (video) token per image (video), as a chat
    template renders it) and its images and videos: the prompt with each image token repeated as many times
    as the image has tokens, each video token replaced as HF's processor replaces it (Qwen3-VL: each temporal
    patch's timestamp text and its tokens between vision start and end), the pixels, grids and token types.
    A video's pixels are :class:`~actors.engine.video.VideoProcessor`'s (HF's video processors need
    torchvision, not installed here)."""
    from transformers import AutoConfig, AutoImageProcessor

    from actors.engine.tokenizer import load_tokenizer
    from actors.engine.video import VideoProcessor

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    qwen3, merge = config.model_type.startswith("qwen3_vl"), config.vision_config.spatial_merge_size
    inputs = {}
    if images:
        pixels = AutoImageProcessor.from_pretrained(model_path, local_files_only=True)(images=list(images),
                                                                                      return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    counts = iter([] if not images else (pixels["image_grid_thw"].prod(-1) // merge ** 2).tolist())
    processed = [VideoProcessor.from_pretrained(model_path, qwen3)(video) for video in videos]
    if processed:
        inputs.update(pixel_values_videos=torch.cat([v.pixel_values for v in processed]),
                      video_grid_thw=torch.tensor([v.grid_thw for v in processed]))
        if not qwen3:
            inputs["second_per_grid_ts"] = torch.tensor([v.seconds_per_grid_t for v in processed])
    tokenizer, videos = load_tokenizer(model_path), iter(processed)

    def video_ids(video) -> List[int]:  # (HF's Qwen2_5_VLProcessor / Qwen3VLProcessor.replace_video_token)
        t, h, w = video.grid_thw
        if not qwen3:
            return [config.video_token_id] * (t * h * w // merge ** 2)
        text = "".join(f"<{video.timestamps[i]:.1f} seconds><|vision_start|>" + "<|video_pad|>" * (h * w // merge ** 2)
                       + "<|vision_end|>" for i in range(t))
        return tokenizer.encode(text, add_special_tokens=False)

    ids = [t for token in prompt for t in ([token] * next(counts) if token == config.image_token_id else
                                          video_ids(next(videos)) if token == config.video_token_id else [token])]
    input_ids = torch.tensor([ids])
    types = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()
    return dict(input_ids=input_ids, mm_token_type_ids=types, **inputs)


def hf_greedy(model_path: str, prompt: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int],
              images: Optional[Sequence] = None, videos: Optional[Sequence] = None):
    """HF's greedy continuation of ``prompt`` (with its ``images`` and ``videos``) and the logits of every step."""
    model = hf_model(model_path)
    inputs = (hf_image_inputs(model_path, prompt, images or (), videos or ()) if images or videos
              else dict(input_ids=torch.tensor([list(prompt)])))
    prompt = inputs["input_ids"][0]
    with torch.no_grad():
        out = model.generate(
            # every position is real: without a mask HF infers one that hides the prompt's pad-id tokens
            # (a follow-up turn holds the model's earlier answer, which may contain it)
            **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=list(eos_token_ids) or None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [step[0] for step in out.logits]


def assert_greedy_parity(model_path: str, prompts: List[List[int]], outputs: List[List[int]], max_new_tokens: int,
                         eos_token_ids: Sequence[int] = (), tie_tol: float = 1e-4,
                         logprobs: Optional[List[List[float]]] = None, logprob_tol: float = 1e-3,
                         images: Optional[List[Optional[Sequence]]] = None,
                         videos: Optional[List[Optional[Sequence]]] = None) -> None:
    """``logprobs``: our log-probability of each output token (``return_logprob``); when
    given, each must also equal HF's, up to the first divergence — a field that shifts
    every logit a little fails here even where the argmax survives. ``images`` (``videos``): each
    prompt's images (videos; None: none)."""
    for n, (prompt, ours) in enumerate(zip(prompts, outputs)):
        ref, logits = hf_greedy(model_path, prompt, max_new_tokens, eos_token_ids, images and images[n],
                                videos and videos[n])
        for i, (a, b) in enumerate(zip(ours, ref)):
            if logprobs is not None:
                want = float(torch.log_softmax(logits[i].float(), dim=-1)[a])
                assert abs(logprobs[n][i] - want) <= logprob_tol, (
                    f"token {i}: our logprob {logprobs[n][i]:.5f}, HF {want:.5f} (prompt {prompt[:8]}...)")
            if a != b:
                gap = float(logits[i].max() - logits[i][a])
                assert gap <= tie_tol, f"token {i}: ours {a}, HF {b}, logit gap {gap:.2e} (prompt {prompt[:8]}...)"
                break
        else:
            assert len(ours) == len(ref), f"lengths differ: ours {len(ours)}, HF {len(ref)}"


def hf_prompt_logprobs(model_path: str, prompt: Sequence[int]) -> torch.Tensor:
    """HF's fp32 log-softmax over the prompt: row ``q`` is the distribution of token ``q + 1``."""
    with torch.no_grad():
        logits = hf_model(model_path)(torch.tensor([list(prompt)])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_input_logprobs_close(model_path: str, prompt: Sequence[int], meta: dict, logprob_start_len: int,
                                top_logprobs_num: int = 0, logprob_tol: float = 1e-3) -> None:
    """``meta``'s ``input_token_logprobs`` (SGLang's: prompt positions from ``logprob_start_len``,
    position 0's None), ``input_token_ranks`` and ``input_top_logprobs`` equal HF's log-softmax over
    the prompt; a rank is counted over HF's whole row, the tokens within ``logprob_tol`` of the
    prompt token's either side of it."""
    ref = hf_prompt_logprobs(model_path, prompt)
    pairs, ranks, tops = meta["input_token_logprobs"], meta["input_token_ranks"], meta["input_top_logprobs"]
    assert [t for _, t in pairs] == list(prompt[logprob_start_len:]) and len(ranks) == len(pairs)
    for i, (logprob, token) in enumerate(pairs):
        pos = logprob_start_len + i
        if pos == 0:
            assert logprob is None and ranks[0] is None and (not tops or tops[0] is None)
            continue
        want = float(ref[pos - 1, token])
        assert abs(logprob - want) <= logprob_tol, f"position {pos}: ours {logprob:.5f}, HF {want:.5f}"
        others = torch.cat([ref[pos - 1, :token], ref[pos - 1, token + 1:]])
        best, worst = 1 + int((others > want + logprob_tol).sum()), 1 + int((others > want - logprob_tol).sum())
        assert best <= ranks[i] <= worst, f"position {pos}: our rank {ranks[i]}, HF {best}..{worst}"
        if top_logprobs_num:
            values, ids = ref[pos - 1].topk(top_logprobs_num)
            got = tops[i]
            assert len(got) == top_logprobs_num
            assert all(abs(g - w) <= logprob_tol for (_, g), w in zip(got, values.tolist())), (pos, got, values)
            # ids may swap only between near-equal values
            assert all(t == w or abs(float(ref[pos - 1, t]) - float(ref[pos - 1, w])) <= logprob_tol
                       for (t, _), w in zip(got, ids.tolist()))


def assert_embedding_close(model_path: str, prompt: Sequence[int], embedding: Sequence[float],
                           dimensions: Optional[int] = None, normalize: bool = True, atol: float = 1e-4) -> None:
    """``embedding`` equals HF's final-norm hidden state of the prompt's last token (its model's
    ``last_hidden_state``), cut to ``dimensions`` and then L2-normalised (unless not ``normalize``)."""
    with torch.no_grad():
        want = hf_model(model_path).model(torch.tensor([list(prompt)])).last_hidden_state[0, -1].float()
    want = want[:dimensions] if dimensions else want
    if normalize:
        want = torch.nn.functional.normalize(want, dim=-1)
    got = torch.tensor(list(embedding))
    assert got.shape == want.shape, f"{got.shape[0]} dimensions, HF {want.shape[0]}"
    assert torch.allclose(got, want, atol=atol), f"max difference {float((got - want).abs().max()):.2e}"


def hf_classifier_score(model_path: str, prompt: Sequence[int], token_ids: Sequence[int]) -> float:
    """vLLM's classifier from two tokens by HF: ``sigmoid(logit_true - logit_false)`` from the full
    logits of the prompt's last position (``token_ids``: the false token's id, the true one's)."""
    with torch.no_grad():
        logits = hf_model(model_path)(torch.tensor([list(prompt)])).logits[0, -1].float()
    return float(torch.sigmoid(logits[token_ids[1]] - logits[token_ids[0]]))


def hf_cosine(model_path: str, prompt_1: Sequence[int], prompt_2: Sequence[int]) -> float:
    """The cosine of HF's final-norm hidden states of two prompts' last tokens."""
    with torch.no_grad():
        a, b = (hf_model(model_path).model(torch.tensor([list(p)])).last_hidden_state[0, -1].float()
                for p in (prompt_1, prompt_2))
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))
