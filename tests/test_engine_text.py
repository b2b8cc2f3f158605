"""Text in, text out, on the built-in tiny model: prompts, stop strings, seeds, the CLI."""

import pytest

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from cluster.cli import main as cli_main


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0)
    eng = Engine(model_path=str(path), max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_text_prompt_and_token_prompt_agree(engine):
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    by_text = engine.generate(prompt="The quick brown fox", sampling_params=params)
    ids = engine.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    by_ids = engine.generate(input_ids=ids, sampling_params=params)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["text"] == engine.tokenizer.decode(by_text["output_ids"], skip_special_tokens=True)


def test_a_batch_of_text_prompts_keeps_its_order(engine):
    """``generate(prompt=[...])``: one result per prompt, in order, each as the prompt alone gives."""
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    prompts = ["a batch", "of text prompts", "in order"]
    outs = engine.generate(prompt=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [engine.generate(prompt=p, sampling_params=params)["output_ids"]
                                               for p in prompts]
    engine.check_integrity()


def test_stop_string_cuts_the_text_before_it(engine):
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    full = engine.generate(prompt="stop strings", sampling_params=params)["text"]
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].isprintable() and full[i : i + 2].strip())
    out = engine.generate(prompt="stop strings", sampling_params={**params, "stop": [stop]})
    assert out["text"] == full[: full.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    engine.check_integrity()


def test_a_stop_token_id_ends_the_output_ids_but_not_the_text(engine):
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    full = engine.generate(prompt="stop tokens", sampling_params=params)
    decode = engine.tokenizer.decode
    first = {t: i for i, t in reversed(list(enumerate(full["output_ids"])))}  # where each token first comes
    stop = next(t for t, i in first.items() if i >= 2 and decode([t]).isprintable() and decode([t]).strip())
    out = engine.generate(prompt="stop tokens", sampling_params={**params, "stop_token_ids": [stop]})
    ids = full["output_ids"][: full["output_ids"].index(stop) + 1]
    assert out["output_ids"] == ids and out["text"] == decode(ids[:-1])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_seeds_make_sampling_reproducible(engine):
    def sample(seed):
        params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "seed": seed, "ignore_eos": True}
        return engine.generate(prompt="sampling", sampling_params=params)["output_ids"]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_cli_generate_prints_the_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYDIX_HOME", str(tmp_path))
    assert cli_main(["generate", "--prompt", "hi", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama-seed0" in out and '"completion_tokens": 4' in out


def test_cli_generate_refuses_a_bad_setting_without_a_traceback(tmp_path, monkeypatch, capsys):
    """An unknown family is an argparse error listing the known ones; --device cuda on a host
    without CUDA exits with the reason (it raised torch's assertion from deep in the engine)."""
    import torch

    from actors.engine.tiny import FAMILIES
    from cluster.cli import FAMILIES as CLI_FAMILIES

    assert CLI_FAMILIES == FAMILIES
    with pytest.raises(SystemExit) as exit_:
        cli_main(["generate", "--family", "llama2"])
    assert exit_.value.code == 2 and "invalid choice: 'llama2'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="raydix generate: device 'cuda': CUDA is not available"):
        cli_main(["generate", "--model-path", str(tmp_path), "--device", "cuda"])
