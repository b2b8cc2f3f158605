"""A multi-node layout on one machine: ``ray.cluster_utils.Cluster`` with one node
declaring the ``prefill`` resource and one declaring ``decode``. Workers are
placed by those resources, so each pair sits on two nodes and the automatic
backend choice is the cross-node one (``torch_dist`` over gloo); tokens still
equal HF transformers'."""

import asyncio

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.config import parse_config
from cluster.pd import PDCluster
from tests.parity import assert_greedy_parity
from tests.pd_helpers import prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_node_ray(tmp_path_factory):
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=2, resources={"prefill": 1})
    cluster.add_node(num_cpus=2, resources={"decode": 1})
    home = tmp_path_factory.mktemp("raydix-home")
    env = {"RAYDIX_TRANSFER_HOST": "127.0.0.1", "RAYDIX_HOME": str(home)}
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, namespace="raydix-multinode")
    yield home
    ray.shutdown()
    cluster.shutdown()


def _cross_node_config(decode_tp: int):
    engine = {"page_size": 4, "max_total_tokens": 2048, "skip_tokenizer_init": True}
    return parse_config({
        "model": {"builtin": "llama"},
        "prefill": {"num_cpus_per_rank": 0.5, "engine": engine},
        "decode": {"num_cpus_per_rank": 0.5, "tp_size": decode_tp, "engine": engine},
        "transfer": {"backend": "auto"},
        "placement": {"use_node_resources": True},
    })


def test_cross_node_pair_uses_torch_dist_and_matches_hf(two_node_ray, monkeypatch):
    """Prefill TP 1 → decode TP 2 on another node: each decode rank receives its half of the
    heads over its own gloo pair (rank 0 as a TP 1 worker would, the follower through its
    expect/land calls). (torch_dist between TP 1 workers: tests/test_pd_workers.py, in-process.)"""
    monkeypatch.setenv("RAYDIX_HOME", str(two_node_ray))
    cluster = PDCluster(_cross_node_config(2)).start()
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    assert prefill.node_id != decode.node_id
    client = cluster.client()
    batch = prompts(3, 5, 40, seed=1)

    async def go():
        return await asyncio.gather(*(client.generate(ids, {"max_new_tokens": 8, "temperature": 0}) for ids in batch))

    outs = asyncio.run(go())
    assert_greedy_parity(cluster.model_path, batch, [o["output_ids"] for o in outs], 8, [2])
    loads = ray.get([prefill.handle.load.remote(), decode.handle.load.remote()])
    assert loads[0]["bytes_pushed"] > 0
    assert ray.get(decode.handle.backends_used.remote()) == {"torch_dist": 3}
    cluster.check_integrity()
    cluster.shutdown()
