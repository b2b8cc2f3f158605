"""The torch_dist data channel on the CPU: what a decode endpoint advertises,
which transport a pair picks, and clear errors where NCCL cannot work. The
NCCL path itself needs two GPUs (``test_transfer_backends.py``, marked gpu)."""

import pytest
import torch

from tests.transfer_helpers import RankSpec, build_pool, push_one
from transfer import KVHandoff, KVPoll, KVReceiver, KVSender, TransferError, create_agent
from transfer.backends.dist_data import DATA_TRANSPORTS, choose_data_transport, nccl_device


def test_torch_dist_cpu_pools_advertise_gloo_and_their_pairs_use_it():
    _, layout, src, _ = build_pool(RankSpec(seed=1))
    _, dlayout, dst, _ = build_pool(RankSpec(seed=2))
    prefill, decode = create_agent("torch_dist", layout, src), create_agent("torch_dist", dlayout, dst)
    try:
        assert decode.endpoint()["data"] == "gloo"
        push_one(prefill, decode, [3, 4, 9], [7, 8, 2])
        assert prefill.link_transports == {decode.agent_id: "gloo"}
        assert decode.link_transports == {prefill.agent_id: "gloo"}
    finally:
        prefill.close()
        decode.close()
    for name in src:  # random bytes: compared as bytes (NaN != NaN)
        assert torch.equal(dst[name][[7, 8, 2]].view(torch.uint8), src[name][[3, 4, 9]].view(torch.uint8))


def test_torch_dist_forcing_nccl_where_it_cannot_work_fails_at_creation():
    _, layout, tensors, _ = build_pool(RankSpec())
    with pytest.raises(ValueError, match="data_transport='nccl' needs NCCL between CUDA pools: the pools are on cpu, "):
        create_agent("torch_dist", layout, tensors, data_transport="nccl")
    with pytest.raises(ValueError, match="data_transport must be one of auto, gloo, nccl; got 'rdma'"):
        create_agent("torch_dist", layout, tensors, data_transport="rdma")
    mixed = {"a": torch.empty(2), "b": torch.empty(2, device="meta")}
    with pytest.raises(ValueError, match="the pools are on cpu, meta, not on one CUDA device"):
        nccl_device("nccl", mixed)
    assert nccl_device("auto", mixed) is None and nccl_device("gloo", tensors) is None
    agent = create_agent("torch_dist", layout, tensors, data_transport="gloo")
    try:
        assert agent.endpoint()["data"] == "gloo"
    finally:
        agent.close()


@pytest.mark.parametrize("mode, local_nccl, peer_data, expected", [
    ("auto", True, "nccl", "nccl"),
    ("auto", True, "gloo", "gloo"),   # auto falls back when the decode side cannot
    ("auto", False, "nccl", "gloo"),  # ... or this side cannot
    ("gloo", False, "nccl", "gloo"),  # gloo mode never reports NCCL locally
    ("nccl", True, "nccl", "nccl"),
    ("nccl", True, "gloo", None),     # an explicit nccl does not fall back
])
def test_torch_dist_data_transport_choice(mode, local_nccl, peer_data, expected):
    assert set(DATA_TRANSPORTS) == {"auto", "gloo", "nccl"}
    if expected is None:
        with pytest.raises(TransferError, match="takes payloads over gloo only"):
            choose_data_transport(mode, local_nccl, peer_data)
    else:
        assert choose_data_transport(mode, local_nccl, peer_data) == expected


def test_torch_dist_prefill_demanding_nccl_fails_against_a_gloo_endpoint():
    """A prefill agent in mode nccl (its CUDA device simulated: nothing reaches it)
    and a CPU decode rank: the push fails naming why, and no pair is opened."""
    _, layout, tensors, _ = build_pool(RankSpec())
    prefill, decode = create_agent("torch_dist", layout, tensors), create_agent("torch_dist", layout, tensors)
    prefill.data_transport, prefill._nccl_device = "nccl", torch.device("cuda", 0)
    try:
        receiver, sender = KVReceiver(decode, "r", 1), KVSender(prefill, "r")
        sender.init(KVHandoff.from_bytes(receiver.send_metadata([5, 6]).to_bytes()))
        sender.send([1, 2])
        assert sender.poll() == KVPoll.Failed
        assert "data_transport='nccl', but the decode rank takes payloads over gloo only" in sender.failure_reason()
        assert prefill.link_transports == {} == decode.link_transports
    finally:
        prefill.close()
        decode.close()
