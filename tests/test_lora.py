"""Multi-LoRA serving: in one mixed batch (base requests and two adapters of different ranks
and targets), each request's greedy tokens equal HF's on the base checkpoint with its adapter
merged into the weights, at TP 1, 2 and 4 and through a PD pair; prefixes are shared only within one
adapter; over HTTP the model field names the adapter; a bad adapter or an unknown adapter name fails
naming it. More adapters than device slots swap through them; adapters load and unload at runtime
(engine, TP ranks, HTTP, both PD workers), also into an engine started without any (its slots from
lora_target_modules and max_lora_rank), up to max_loaded_loras."""

import asyncio
import json
import random

import pytest
from safetensors.torch import load_file, save_file

from actors.engine import Engine
from actors.engine.config import EngineConfig
from actors.engine.lora import read_adapter
from actors.engine.tiny import build_tiny_checkpoint, make_adapter
from tests.lora_helpers import adapters_and_oracles, merged_checkpoint
from tests.parity import assert_embedding_close, assert_greedy_parity
from tests.tp_helpers import thread_ranks

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(base checkpoint, adapter dirs by name, merged checkpoints by name)."""
    root = tmp_path_factory.mktemp("lora")
    base = str(build_tiny_checkpoint("llama", root / "base", seed=0))
    adapters, oracles = adapters_and_oracles(base, root)
    return base, adapters, oracles


def prompts(n, seed=0, shared=()):
    rng = random.Random(seed)
    return [list(shared) + [rng.randrange(5, 261) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def engine(model, **args):
    base, adapters, _ = model
    return Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=2048, lora_paths=adapters, **args)


def assert_parity(model, batch, loras, outs, eos):
    """Each request's tokens equal HF's on its merged checkpoint (the base one for no adapter)."""
    base, _, oracles = model
    for prompt, lora, out in zip(batch, loras, outs):
        assert_greedy_parity(oracles.get(lora, base), [prompt], [out["output_ids"]], GREEDY["max_new_tokens"], eos)


def assert_batch_parity(model, eng, batch, loras):
    """``batch`` in one generate, each under its adapter of ``loras``: its tokens are its merged
    model's, and the engine's pools stay whole. Returns the outputs."""
    outs = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=loras)
    assert_parity(model, batch, loras, outs, eng.eos_token_ids)
    eng.check_integrity()
    return outs


@pytest.mark.parametrize("args", [{}, {"chunked_prefill_size": 8, "page_size": 4}], ids=["plain", "chunked-paged"])
def test_mixed_batch_equals_merged_models(model, args):
    """One batch mixes the base model and both adapters (the slots' token groups interleave in a
    prefill and a decode step); each adapter changes the tokens of the same prompt."""
    eng = engine(model, **args)
    try:
        batch = prompts(3) * 3
        loras = [None] * 3 + ["sql"] * 3 + ["chat"] * 3
        order = [0, 3, 6, 1, 4, 7, 2, 5, 8]  # interleaved: no slot's requests are contiguous
        outs = eng.generate(input_ids=[batch[i] for i in order], sampling_params=GREEDY,
                            lora_path=[loras[i] for i in order])
        outs = [outs[order.index(i)] for i in range(len(batch))]
        assert_parity(model, batch, loras, outs, eng.eos_token_ids)
        tokens = [o["output_ids"] for o in outs]
        for i in range(3):  # the adapters do change what the model says
            assert len({tuple(tokens[i]), tuple(tokens[3 + i]), tuple(tokens[6 + i])}) == 3, tokens[i::3]
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def three(model, tmp_path_factory):
    """``model`` with a third adapter, ``math`` (r=2 on k/o/up), and its merged checkpoint."""
    base, adapters, oracles = model
    root = tmp_path_factory.mktemp("lora3")
    path = make_adapter(base, root / "math", rank=2, alpha=4, targets=("k_proj", "o_proj", "up_proj"), seed=3)
    return base, {**adapters, "math": str(path)}, {**oracles, "math": merged_checkpoint(base, path, root / "merged")}


def watch_slots(eng, num_slots):
    """Check at every forward that the running requests and the batch use at most ``num_slots``
    adapters, and that each request's slot holds its adapter; returns the adapters each forward
    copied into a slot."""
    sched, lora, forward = eng.scheduler, eng.runner.lora, eng.runner.forward
    loads = []

    def checked(forward_batch):
        before = list(lora.loaded)
        out = forward(forward_batch)
        reqs = sched.in_flight if forward_batch.forward_mode.is_extend else sched.running
        assert len({r.lora_path for r in sched.running + reqs} - {None}) <= num_slots
        if forward_batch.lora_slots is not None:
            assert [lora.loaded[s] for s in forward_batch.lora_slots if s >= 0] == [
                r.lora_path for r in reqs if r.lora_path is not None]
        loads.extend(name for old, name in zip(before, lora.loaded) if name != old)
        return out

    eng.runner.forward = checked
    return loads


@pytest.mark.parametrize("num_slots, args", [(2, {}), (1, {"chunked_prefill_size": 8, "page_size": 4})],
                         ids=["2-slots", "1-slot-chunked-paged"])
def test_adapters_swap_through_fewer_slots(three, num_slots, args):
    """Three adapters through fewer device slots: a request whose adapter finds no slot free of
    the running requests' adapters waits (never an error), one that frees gives way to it; every
    request's tokens are its merged model's."""
    eng = engine(three, max_loras_per_batch=num_slots, **args)
    try:
        loads = watch_slots(eng, num_slots)
        batch = prompts(2, seed=9) * 4
        loras = [None, None, "sql", "sql", "chat", "chat", "math", "math"]
        order = [0, 2, 4, 6, 1, 3, 5, 7]  # interleaved adapters
        outs = eng.generate(input_ids=[batch[i] for i in order], sampling_params=GREEDY,
                            lora_path=[loras[i] for i in order])
        outs = [outs[order.index(i)] for i in range(len(batch))]
        assert_parity(three, batch, loras, outs, eng.eos_token_ids)
        assert set(loads) == {"sql", "chat", "math"} and len(loads) >= 3
        assert eng.runner.lora.loaded.count(None) == 0 and len(eng.runner.lora.loaded) == num_slots
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_the_slots_as_their_layers(model, monkeypatch, tp_size):
    """TP 2 splits the KV heads, TP 4 replicates them: column-parallel layers hold their rows of B,
    row-parallel ones their columns of A (their deltas summed by the layer's all-reduce); the mixed
    batch's tokens are still the merged models'. The ranks are threads (tests.tp_helpers)."""
    thread_ranks(monkeypatch)
    eng = engine(model, tp_size=tp_size, chunked_prefill_size=8)
    try:
        assert_batch_parity(model, eng, prompts(3, seed=3), ["chat", None, "sql"])
    finally:
        eng.shutdown()


def test_prefixes_shared_only_within_an_adapter(model):
    """A prompt cached under one adapter is no hit under another or the base model (its KV differs);
    under the same adapter it is, and the tokens stay the merged model's."""
    eng = engine(model)
    try:
        system = prompts(1, seed=5)[0] * 3  # a long shared prefix
        first = prompts(1, seed=6, shared=system)[0]
        follow = prompts(1, seed=7, shared=system)[0]
        assert eng.generate(input_ids=first, sampling_params=GREEDY, lora_path="sql")["meta_info"]["cached_tokens"] == 0
        others = eng.generate(input_ids=[follow, follow], sampling_params=GREEDY, lora_path=["chat", None])
        assert [o["meta_info"]["cached_tokens"] for o in others] == [0, 0]
        same = eng.generate(input_ids=follow, sampling_params=GREEDY, lora_path="sql")
        assert same["meta_info"]["cached_tokens"] >= len(system)
        assert_parity(model, [follow] * 3, ["chat", None, "sql"], others + [same], eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_encode_pools_each_prompt_under_its_adapter(model):
    """Engine.encode and async_encode take ``lora_path`` as generate does: each vector is the
    merged model's hidden state (an adapter's embeddings are its own)."""
    base, _, oracles = model
    eng = engine(model)
    try:
        ids = prompts(2, seed=8)
        outs = eng.encode(input_ids=ids, lora_path=["chat", None])
        assert_embedding_close(oracles["chat"], ids[0], outs[0]["embedding"])
        assert_embedding_close(base, ids[1], outs[1]["embedding"])
        assert_embedding_close(oracles["sql"], ids[0],
                               asyncio.run(eng.async_encode(input_ids=ids[0], lora_path="sql"))["embedding"])
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_unknown_adapter_is_refused_at_submit(model):
    eng = engine(model)
    try:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'; loaded: sql, chat"):
            eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="nope")
        eng.check_integrity()
    finally:
        eng.shutdown()
    plain = Engine(model_path=model[0], skip_tokenizer_init=True, max_total_tokens=256)
    try:
        with pytest.raises(ValueError, match="serves none"):
            plain.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="sql")
    finally:
        plain.shutdown()


def test_lora_paths_as_sglang_list():
    config = EngineConfig(model_path="m", lora_paths=["sql=/a/sql", "/b/chat"])
    assert config.lora_paths == {"sql": "/a/sql", "/b/chat": "/b/chat"}
    with pytest.raises(ValueError, match="'sql' is given twice"):
        EngineConfig(model_path="m", lora_paths=["sql=/a", "sql=/b"])


def test_lora_capacity_settings_checked_as_sglang():
    """lora_target_modules takes 'all' (every projection); without lora_paths it needs max_lora_rank;
    max_loaded_loras holds at least the slots and the start adapters."""
    assert EngineConfig(model_path="m", lora_target_modules="all", max_lora_rank=8).lora_target_modules == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
        "gate_up_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "in_proj_qkvz", "in_proj_ba",
        "out_proj", "w1", "w2", "w3"]
    with pytest.raises(ValueError, match="lora_target_modules"):
        EngineConfig(model_path="m", lora_target_modules=["qkv"], max_lora_rank=8)
    with pytest.raises(ValueError, match="max_lora_rank is needed with lora_target_modules and no lora_paths"):
        EngineConfig(model_path="m", lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"max_loaded_loras \(2\) is less than max_loras_per_batch \(8\)"):
        EngineConfig(model_path="m", max_loaded_loras=2)
    with pytest.raises(ValueError, match=r"max_loaded_loras \(1\) is less than the 2 adapters of lora_paths"):
        EngineConfig(model_path="m", max_loaded_loras=1, max_loras_per_batch=1, lora_paths=["a=/a", "b=/b"])


def _rewrite(path, config=None, tensors=None):
    if config is not None:
        settings = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    if tensors is not None:
        save_file(tensors(load_file(str(path / "adapter_model.safetensors"))), str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize("change, error", [
    ({"config": {"use_dora": True}}, "DoRA"),
    ({"config": {"bias": "lora_only"}}, "trained biases"),
    ({"tensors": lambda t: {**t, "base_model.model.lm_head.lora_A.weight": t[next(iter(t))].clone()}}, "lm_head"),
    ({"tensors": lambda t: {k: v for k, v in t.items() if "q_proj.lora_B" not in k}}, "q_proj needs lora_A"),
    ({"tensors": lambda t: {k: v[:, :-1].contiguous() if "k_proj.lora_A" in k else v for k, v in t.items()}}, "do not fit"),
    ({"args": {"max_lora_rank": 2}}, "max_lora_rank=2 is below"),
])
def test_bad_adapter_fails_at_start(model, tmp_path, change, error):
    path = make_adapter(model[0], tmp_path / "bad", rank=4, alpha=8, targets=("q_proj", "k_proj"))
    _rewrite(path, change.get("config"), change.get("tensors"))
    with pytest.raises(ValueError, match=error):
        Engine(model_path=model[0], skip_tokenizer_init=True, max_total_tokens=256, lora_paths={"bad": str(path)},
               **change.get("args", {}))


def test_http_model_field_names_the_adapter(model):
    """vLLM's API: /v1/models lists each adapter with its directory (root) and the base model
    (parent); ``model: <adapter>`` runs a completion under it (the tokens the engine gives under
    that adapter, not the base model's), an unknown model is a 404; SGLang's /generate takes
    ``lora_path``, an unknown one a 400."""
    import httpx
    from transformers import AutoTokenizer

    from cluster.config import ServerConfig
    from cluster.http_server import BackgroundServer
    from cluster.server import build_app
    from tests.test_openai_compat import MODEL, EngineBackend

    base, adapters, _ = model
    eng = Engine(model_path=base, max_total_tokens=2048, lora_paths=adapters)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    try:
        with BackgroundServer(build_app(EngineBackend(eng, 256), tokenizer, ServerConfig()), "127.0.0.1", 0) as server:
            def post(path, body):
                return httpx.post(server.url + path, json=body, timeout=60)

            cards = httpx.get(server.url + "/v1/models", timeout=60).json()["data"]
            assert [(c["id"], c.get("parent"), c.get("root")) for c in cards] == [
                (MODEL, None, None), ("sql", MODEL, adapters["sql"]), ("chat", MODEL, adapters["chat"])]
            assert httpx.get(server.url + "/v1/models/chat", timeout=60).json()["parent"] == MODEL
            texts = {}
            for name in (MODEL, "sql", "chat"):
                r = post("/v1/completions", {"model": name, "prompt": "hello there", "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200 and r.json()["model"] == name, r.text
                texts[name] = r.json()["choices"][0]["text"]
                want = eng.generate(prompt="hello there", sampling_params=GREEDY,
                                    lora_path=None if name == MODEL else name)
                assert texts[name] == want["text"]
            assert len(set(texts.values())) == 3
            vectors = {name: post("/v1/embeddings", {"model": name, "input": "hello there", "encoding_format": "float"})
                       .json()["data"][0]["embedding"] for name in (MODEL, "chat")}
            assert vectors[MODEL] != vectors["chat"]  # (an adapter's embeddings are its hidden states)
            scores = {name: post("/v1/score", {"model": name, "text_1": "hello", "text_2": "there"}).json()
                      for name in (MODEL, "chat")}
            assert scores["chat"]["model"] == "chat" and scores[MODEL]["data"] != scores["chat"]["data"]
            r = post("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 404 and "serves 'tiny', 'sql', 'chat'" in r.json()["error"]["message"]
            r = post("/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "lora_path": "chat"})
            assert r.json()["output_ids"] == eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY,
                                                          lora_path="chat")["output_ids"]
            r = post("/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "lora_path": "nope"})
            assert r.status_code == 400 and "unknown LoRA adapter 'nope'" in r.json()["error"]["message"]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_pd_pair_runs_each_request_under_its_adapter(model):
    """Both workers load the adapters; a request's adapter goes to the decode reservation and the
    prefill: its KV is computed under it, its tokens decoded under it (the merged model's), and
    the prefill side's cache hits only under the same adapter."""
    from tests.pd_helpers import close_workers, make_pair, run_pd

    base, adapters, _ = model
    args = {"lora_paths": adapters}
    prefill, decode = make_pair(base, page_size=4, prefill_args=args, decode_args=args)
    try:
        shared = prompts(1, seed=8)[0]
        batch, loras = prompts(3, seed=4, shared=shared), [None, "sql", "chat"]

        async def go(lora_paths):
            return await asyncio.gather(*(run_pd(prefill, decode, ids, GREEDY, lora_path=lora)
                                          for ids, lora in zip(batch, lora_paths)))

        first = asyncio.run(go(loras))
        assert_parity(model, batch, loras, [final for final, _, _ in first], decode.eos_token_ids)
        again = asyncio.run(go(["sql", "sql", "chat"]))  # prompt 1 again under sql, prompt 0 first time under it
        # prompt 0: the shared prefix prompt 1 cached under sql, not its own base-model pages; 1 and 2: whole
        # pages short of their last token
        cached = [notice["cached_tokens"] for _, notice, _ in again]
        assert cached == [len(shared) // 4 * 4, (len(batch[1]) - 1) // 4 * 4, (len(batch[2]) - 1) // 4 * 4]
        assert [f["output_ids"] for f, _, _ in again[1:]] == [f["output_ids"] for f, _, _ in first[1:]]
    finally:
        close_workers(prefill, decode)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_load_and_unload_at_runtime(three, monkeypatch, tp_size):
    """An adapter loaded while the engine serves (on every TP rank) runs as the merged model; unloaded,
    it is refused; loaded again under its name with other weights, the first one's cached prefixes
    are no hit for it (its own cache key) and its tokens are the new weights'."""
    thread_ranks(monkeypatch)
    base, adapters, oracles = three
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=2048, tp_size=tp_size,
                 lora_paths={name: adapters[name] for name in ("sql", "chat")}, max_loras_per_batch=2)
    try:
        batch = prompts(2, seed=11)
        with pytest.raises(ValueError, match="unknown LoRA adapter 'math'"):
            eng.generate(input_ids=batch[0], sampling_params=GREEDY, lora_path="math")
        eng.load_lora_adapter("math", adapters["math"])
        with pytest.raises(ValueError, match="'math' is loaded already"):
            eng.load_lora_adapter("math", adapters["math"])
        loras = ["math", "sql"]
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=loras)
        assert_parity(three, batch, loras, outs, eng.eos_token_ids)
        eng.unload_lora_adapter("math")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'math'; loaded: sql, chat"):
            eng.generate(input_ids=batch[0], sampling_params=GREEDY, lora_path="math")
        eng.load_lora_adapter("math", adapters["chat"])  # the name again, other weights
        again = eng.generate(input_ids=batch[0], sampling_params=GREEDY, lora_path="math")
        assert again["meta_info"]["cached_tokens"] == 0
        assert_parity(three, [batch[0]], ["chat"], [again], eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_load_reads_its_files_while_the_engine_steps(three, monkeypatch, tp_size):
    """A runtime load reads the adapter's files outside the engine loop's lock, on every TP rank: a
    request runs to its end while each rank's read is held up; once read, the adapter serves as its
    merged model."""
    import threading

    from actors.engine import model_runner

    thread_ranks(monkeypatch)
    base, adapters, _ = three
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=2048, tp_size=tp_size,
                 lora_paths={"sql": adapters["sql"]}, max_loras_per_batch=2)
    step, stepped = eng.scheduler.step, threading.Condition()
    steps, reads, stepped_in_read = [0], [], []

    def counted_step():
        produced = step()
        with stepped:
            steps[0] += 1
            stepped.notify_all()
        return produced

    def slow_read(name, path):  # (a rank's read waits for a step to end meanwhile, 10 s at most)
        with stepped:
            reads.append(steps[0])
            stepped.notify_all()
            stepped_in_read.append(stepped.wait_for(lambda: steps[0] > reads[-1], timeout=10))
        return read_adapter(name, path)

    monkeypatch.setattr(eng.scheduler, "step", counted_step)
    monkeypatch.setattr(model_runner, "read_adapter", slow_read)
    batch = prompts(2, seed=17)
    try:
        load = threading.Thread(target=eng.load_lora_adapter, args=("math", adapters["math"]))
        load.start()
        with stepped:
            assert stepped.wait_for(lambda: len(reads) == tp_size, timeout=30)
        eng.generate(input_ids=batch[0], sampling_params=GREEDY, lora_path="sql")
        load.join()
        assert stepped_in_read == [True] * tp_size
        assert_batch_parity(three, eng, batch, ["math", "sql"])
    finally:
        eng.shutdown()


def test_racing_loads_of_one_name_leave_one_adapter(three, monkeypatch):
    """Two loads of one name whose reads overlap: the first to claim the name serves it on every TP
    rank, under the name as its cache key; the other is refused and changes nothing."""
    import threading

    from actors.engine import model_runner

    thread_ranks(monkeypatch)
    base, adapters, _ = three
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=2048, tp_size=2,
                 lora_paths={"sql": adapters["sql"]}, max_loras_per_batch=2)
    both_reading = threading.Barrier(2, timeout=10)

    def read_together(name, path):  # (a follower's read, in the winner's install, goes straight through)
        if threading.current_thread().name.startswith("load"):
            both_reading.wait()
        return read_adapter(name, path)

    monkeypatch.setattr(model_runner, "read_adapter", read_together)
    outcomes = {}

    def load(weights):
        try:
            eng.load_lora_adapter("new", adapters[weights])
            outcomes[weights] = "loaded"
        except ValueError as exc:
            outcomes[weights] = str(exc)

    try:
        loads = [threading.Thread(target=load, args=(weights,), name=f"load-{weights}") for weights in ("math", "chat")]
        for thread in loads:
            thread.start()
        for thread in loads:
            thread.join()
        [winner] = [weights for weights, outcome in outcomes.items() if outcome == "loaded"]
        assert list(outcomes.values()).count("LoRA adapter 'new' is loaded already") == 1
        assert eng.runner.lora.host["new"].cache_key == "new" and eng.runner.lora.num_loads["new"] == 1
        prompt = prompts(1, seed=18)[0]
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="new")
        assert_parity(three, [prompt], [winner], [out], eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_runtime_loads_without_start_adapters(three, tmp_path):
    """SGLang's --lora-target-modules with --max-lora-rank: an engine started with no adapter builds its
    slots from them, so adapters loaded at runtime within them run as their merged models (beside
    the base model); one of a higher rank or targeting a projection outside them is refused naming
    the field."""
    base, adapters, _ = three
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=2048, max_lora_rank=4,
                 lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                 max_loras_per_batch=2)
    try:
        with pytest.raises(ValueError, match="max_lora_rank=4 is below the rank of LoRA adapter.* sql"):
            eng.load_lora_adapter("sql", adapters["sql"])  # (r=8)
        gate = make_adapter(base, tmp_path / "gate", rank=2, alpha=4, targets=("q_proj", "gate_proj"))
        with pytest.raises(ValueError, match=r"'gate' targets model.layers.0.mlp.gate_proj.*outside the layers "
                                             r"that take adapters: those of lora_target_modules="):
            eng.load_lora_adapter("gate", str(gate))
        for name in ("chat", "math"):  # (r=4 on q/v/down, r=2 on k/o/up)
            eng.load_lora_adapter(name, adapters[name])
        assert_batch_parity(three, eng, prompts(3, seed=15), [None, "chat", "math"])
    finally:
        eng.shutdown()


def test_max_loaded_loras_caps_the_adapters_in_host_memory(three):
    """SGLang's max_loaded_loras (vLLM's max_cpu_loras): a load beyond the cap is refused, naming it;
    once an adapter is unloaded another loads and serves."""
    base, adapters, _ = three
    eng = Engine(model_path=base, skip_tokenizer_init=True, max_total_tokens=2048, max_loras_per_batch=2,
                 lora_paths={name: adapters[name] for name in ("sql", "chat")}, max_loaded_loras=3)
    try:
        eng.load_lora_adapter("math", adapters["math"])
        with pytest.raises(ValueError, match=r"'more': max_loaded_loras=3 adapters are in host memory already "
                                             r"\(sql, chat, math\)"):
            eng.load_lora_adapter("more", adapters["math"])
        assert "more" not in eng.runner.lora.host
        eng.unload_lora_adapter("chat")
        eng.load_lora_adapter("more", adapters["math"])
        prompt = prompts(1, seed=16)[0]
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="more")
        assert_parity(three, [prompt], ["math"], [out], eng.eos_token_ids)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_unload_waits_for_the_requests_in_flight(three):
    """SGLang's unload: refused to new requests at once, gone once the request in flight under it has
    finished — under it, all its tokens the merged model's."""
    import asyncio
    import threading

    eng = engine(three, max_loras_per_batch=2)
    params = {**GREEDY, "max_new_tokens": 24}
    prompt = prompts(1, seed=12)[0]
    try:
        async def go():
            eng.loop.pause()  # the request stays in flight until resumed
            stream = await eng.async_generate(input_ids=prompt, sampling_params=params, lora_path="math", stream=True)
            unload = threading.Thread(target=eng.unload_lora_adapter, args=("math",))
            unload.start()
            while "math" not in eng.runner.lora.retiring:
                await asyncio.sleep(0.001)
            with pytest.raises(ValueError, match="unknown LoRA adapter 'math'"):
                eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="math")
            await asyncio.sleep(0.05)
            assert unload.is_alive() and "math" in eng.runner.lora.host
            eng.loop.resume()
            outs = [out async for out in stream]
            await asyncio.to_thread(unload.join)
            return outs[-1]

        final = asyncio.run(go())
        assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 24
        assert_greedy_parity(three[2]["math"], [prompt], [final["output_ids"]], 24, eng.eos_token_ids)
        assert "math" not in eng.runner.lora.host and "math" not in eng.runner.lora.slot_names
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_request_checked_before_its_adapter_was_unloaded_ends_aborted(three):
    """A request that passed its check just before its adapter's unload, and was queued after it,
    ends aborted at admission (its adapter's weights are gone), not the step."""
    import threading

    eng = engine(three, max_loras_per_batch=2)
    try:
        req = eng._make_req(GREEDY, None, prompts(1, seed=14)[0], None, 0, "math")
        eng.unload_lora_adapter("math")
        done, errors = threading.Event(), []

        def told(r, error):  # (a sync caller's callback: it returns no posts)
            if r.finished:
                errors.append(error)
                done.set()

        eng.loop.submit(req, told)
        assert done.wait(30) and errors == [None] and req.finished_reason == {"type": "abort", "message": "aborted"}
        assert eng.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="sql")["output_ids"]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_http_load_and_unload(three):
    """vLLM's runtime LoRA updating: off by default (no such route); on, a loaded adapter is listed
    by /v1/models and serves completions (the engine's tokens under it), a name served already or
    a bad directory is a 400; unloaded, its model name is a 404 again."""
    import httpx
    from transformers import AutoTokenizer

    from cluster.config import ServerConfig
    from cluster.http_server import BackgroundServer
    from cluster.server import build_app
    from tests.test_openai_compat import MODEL, EngineBackend

    base, adapters, _ = three
    eng = Engine(model_path=base, max_total_tokens=2048, lora_paths={"sql": adapters["sql"]}, max_loras_per_batch=1)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    body = {"prompt": "hello there", "max_tokens": 8, "temperature": 0}
    try:
        for allow in (False, True):
            app = build_app(EngineBackend(eng, 256), tokenizer, ServerConfig(allow_runtime_lora_updating=allow))
            with BackgroundServer(app, "127.0.0.1", 0) as server:
                def post(path, data):
                    return httpx.post(server.url + path, json=data, timeout=60)

                r = post("/v1/load_lora_adapter", {"lora_name": "math", "lora_path": adapters["math"]})
                if not allow:
                    assert r.status_code == 404
                    continue
                assert r.status_code == 200, r.text
                cards = httpx.get(server.url + "/v1/models", timeout=60).json()["data"]
                assert [(c["id"], c.get("root")) for c in cards] == [
                    (MODEL, None), ("sql", adapters["sql"]), ("math", adapters["math"])]
                r = post("/v1/completions", {"model": "math", **body})
                want = eng.generate(prompt="hello there", sampling_params=GREEDY, lora_path="math")
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == want["text"]
                for name, path in (("math", adapters["math"]), (MODEL, adapters["math"]), ("x", "/nowhere")):
                    r = post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
                    assert r.status_code == 400, (name, r.text)
                assert "no adapter_config.json" in r.json()["error"]["message"]
                assert post("/v1/unload_lora_adapter", {"lora_name": "math"}).status_code == 200
                assert post("/v1/completions", {"model": "math", **body}).status_code == 404
                assert post("/v1/unload_lora_adapter", {"lora_name": "math"}).status_code == 404
                assert [c["id"] for c in httpx.get(server.url + "/v1/models", timeout=60).json()["data"]] == [MODEL, "sql"]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_pd_backend_loads_on_every_worker(three):
    """PDBackend's load reaches the prefill and the decode worker: a PD request under the new adapter
    is the merged model's on both sides; its unload leaves both refusing it."""
    import asyncio
    from types import SimpleNamespace

    from cluster.backend import PDBackend
    from tests.pd_helpers import close_workers, make_pair, run_pd
    from tests.test_pd_client_retries import _Handle

    base, adapters, _ = three
    args = {"lora_paths": {"sql": adapters["sql"]}, "max_loras_per_batch": 1}
    prefill, decode = make_pair(base, page_size=4, prefill_args=args, decode_args=args)
    refs = [SimpleNamespace(worker_id=w.worker_id, alive=True, handle=_Handle(w)) for w in (prefill, decode)]
    backend = PDBackend(SimpleNamespace(prefill=refs[:1], decode=refs[1:], lora_cache_keys={}),
                        lora_modules=args["lora_paths"])
    try:
        batch, loras = prompts(2, seed=13), ["math", "sql"]
        asyncio.run(backend.load_lora_adapter("math", adapters["math"]))
        assert backend.lora_modules == {"sql": adapters["sql"], "math": adapters["math"]}

        async def go():
            return await asyncio.gather(*(run_pd(prefill, decode, ids, GREEDY, lora_path=lora)
                                          for ids, lora in zip(batch, loras)))

        assert_parity(three, batch, loras, [final for final, _, _ in asyncio.run(go())], decode.eos_token_ids)
        with pytest.raises(ValueError, match="is loaded already"):
            asyncio.run(backend.load_lora_adapter("math", adapters["math"]))
        assert "math" in backend.lora_modules  # (a refused load changes nothing)
        asyncio.run(backend.unload_lora_adapter("math"))
        assert backend.lora_modules == {"sql": adapters["sql"]}
        for worker in (prefill, decode):
            with pytest.raises(ValueError, match="unknown LoRA adapter 'math'"):
                worker._make_req(GREEDY, "r", batch[0], lora_path="math")
    finally:
        close_workers(prefill, decode)


def test_router_matches_a_reloaded_adapters_prefixes(three):
    """A reload's cache key (``name#k``) is PDBackend's, on every worker, and its client routes the
    adapter's requests under it: a router that indexes the workers' trees after a request under the
    reloaded adapter matches its prompt's pages on both workers."""
    from cluster.backend import PDBackend
    from cluster.pd_client import PDClient
    from cluster.pd_rotation import WorkerRef
    from actors.router import Router, RouterSettings
    from tests.pd_helpers import close_workers, make_pair, run_pd
    from tests.test_pd_client_retries import _Handle

    base, adapters, _ = three
    args = {"lora_paths": {"sql": adapters["sql"]}, "max_loras_per_batch": 1}
    prefill, decode = make_pair(base, page_size=4, prefill_args=args, decode_args=args)
    workers = {"prefill": prefill, "decode": decode}
    refs = [WorkerRef(w.worker_id, role, _Handle(w), "n") for role, w in workers.items()]
    client = PDClient(refs[:1], refs[1:])
    backend = PDBackend(client, lora_modules=args["lora_paths"])
    prompt = prompts(1, seed=19, shared=range(5, 18))[0]  # (13 shared tokens and more: three whole pages)

    async def go():
        await backend.load_lora_adapter("math", adapters["chat"])
        await backend.unload_lora_adapter("math")
        await backend.load_lora_adapter("math", adapters["math"])
        await run_pd(prefill, decode, prompt, GREEDY, lora_path="math")
        client.router = router = Router(RouterSettings(page_size=4))  # (its index: the workers' trees alone)
        for role, worker in workers.items():
            await router.add_worker(worker.worker_id, role, worker)
        await client._pick_pair("again", prompt, lora_path="math")
        await router.release("again")
        return router

    try:
        router = asyncio.run(go())
        assert [w.runner.lora.host["math"].cache_key for w in workers.values()] == ["math#1"] * 2
        reusable = (len(prompt) - 1) // 4 * 4
        assert router.counters["matched_tokens"] == router.counters["decode_matched_tokens"] == reusable > 0
        for worker in workers.values():
            worker.check_integrity()
    finally:
        close_workers(prefill, decode)
