"""A draft model's step masks (:class:`~actors.engine.draft_masks.DraftMasks`) against the decode
step's sparse adjustments after the same tokens, bit for bit, and what they copy to the device."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.draft_masks import DraftMasks
from actors.engine.sampling_params import SamplingParams
from actors.engine.sparse_logits import LogitState, adjust_logits
from tests.test_sparse_logits import EOS, VOCAB, request

# each request of a drafting batch: its params, prompt, output (steps) and bad words, its draft, and
# whether it is left out of every step (at the draft's context)
drafted = st.tuples(request, st.lists(st.integers(0, VOCAB - 1), max_size=4), st.booleans())


@settings(max_examples=60, deadline=None)
@given(st.lists(drafted, min_size=1, max_size=5), st.integers(0, 2 ** 31))
def test_each_draft_step_adjusts_as_the_decode_step_after_the_draft_so_far(reqs, seed):
    """Step ``j`` of a batch whose requests leave it as their drafts end (or never join it) adjusts
    each row as :func:`adjust_logits` with the request's state ahead by ``draft[:j]``: penalties over
    prompt and output, or output only, counting the draft; bad words matched across the end of the
    output; min-tokens counting the draft; bias with allowed ids; requests with nothing beside them."""
    gen = torch.Generator().manual_seed(seed)
    states = []
    for (params, prompt, steps, words), _, _ in reqs:
        state = LogitState(params, prompt, EOS, VOCAB, words) if LogitState.needed(params) else None
        if state is not None:
            state.sync([t for step in steps for t in step])
        states.append(state)
    masks, ahead = DraftMasks(states, [None] * len(reqs)), list(states)
    for j in range(max(len(draft) for _, draft, _ in reqs)):
        index = [i for i, (_, draft, left_out) in enumerate(reqs) if len(draft) > j and not left_out]
        if not index:
            return
        logits = torch.randn(len(index), VOCAB, generator=gen) * 4
        want = adjust_logits(logits, [ahead[i] for i in index])
        assert torch.equal(masks.apply(logits.clone(), index), want), j
        tokens = [reqs[i][1][j] for i in index]
        masks.take(index, torch.tensor(tokens))
        for i, t in zip(index, tokens):
            ahead[i] = None if ahead[i] is None else ahead[i].ahead(t)


def test_the_penalties_rows_are_copied_to_the_device_in_as_many_copies_for_any_batch(monkeypatch):
    """The first draft step builds every request's seen mask and counts from its prompt and output:
    in the same few copies to the device for six requests as for one (it copied each request's ids
    and counts on their own: three more copies per request)."""
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5)
    copies = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(self.numel()) or to(self, *a, **k))

    def first_step_copies(n: int) -> int:
        states = [LogitState(params, [1, 2, 3 + i], EOS, VOCAB) for i in range(n)]
        for i, state in enumerate(states):
            state.sync([4, 5 + i % 3, 4])
        masks, logits = DraftMasks(states, [None] * n), torch.randn(n, VOCAB)
        del copies[:]
        got = masks.apply(logits.clone(), list(range(n)))
        num_copies = len(copies)
        assert torch.equal(got, adjust_logits(logits, states))
        return num_copies

    assert first_step_copies(6) == first_step_copies(1)
