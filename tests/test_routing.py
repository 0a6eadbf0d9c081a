"""``fusion_core.integrate_transformers()``: transformers' own entry points load through fusion-core.

Real transformers calls throughout: Auto and model classes, ``pipeline(..., model_kwargs=...)``,
and a Trainer script in its own process. Every fused model is compared with the plain one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import fusion_core
from fusion_core.routing import TransformersIntegration, is_integrated

QKV = {"qkv": True, "gate_up": True}
TF5 = int(transformers.__version__.split(".")[0]) >= 5
IDS = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def integration_off():
    """Every test starts and ends with the integration off, whatever it left behind."""
    fusion_core.integrate_transformers(False)
    yield
    fusion_core.integrate_transformers(False)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _assert_fused_like_plain(model: torch.nn.Module, plain: torch.nn.Module) -> None:
    assert fusion_core.get_fusion_plan(model) is not None
    torch.testing.assert_close(_logits(model), _logits(plain), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [AutoModelForCausalLM, LlamaForCausalLM], ids=["auto", "model-class"])
def test_from_pretrained_with_fusion_config_loads_through_fusion_core(cls, llama):
    plain = AutoModelForCausalLM.from_pretrained(llama)
    with fusion_core.integrate_transformers():
        model = cls.from_pretrained(llama, fusion_config=QKV)
        model_with_info, info = cls.from_pretrained(llama, fusion_config=QKV, output_loading_info=True)
    _assert_fused_like_plain(model, plain)
    assert fusion_core.get_fusion_plan(model_with_info) is not None
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_loads_without_fusion_never_reach_fusion_core(llama, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a load without fusion reached fusion-core")

    monkeypatch.setattr(fusion_core.hf, "from_pretrained", refuse)
    with fusion_core.integrate_transformers():
        plain = AutoModelForCausalLM.from_pretrained(llama)
        by_class = LlamaForCausalLM.from_pretrained(pretrained_model_name_or_path=llama)
    for model in (plain, by_class):
        assert fusion_core.get_fusion_plan(model) is None and not hasattr(model.config, "fusion_core")


def test_a_stored_record_reloads_fused_only_while_integrated(llama, tmp_path):
    fused = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=QKV)
    fused.save_pretrained(tmp_path / "saved")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert fusion_core.get_fusion_plan(plain) is None  # off: plain transformers ignores the record
    with fusion_core.integrate_transformers():
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        explicit_off = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", fusion_config={"qkv": False,
                                                                                              "gate_up": False})
    _assert_fused_like_plain(again, plain)
    paths = [(m.family, m.path) for m in fusion_core.get_fusion_plan(fused).modules]
    assert [(m.family, m.path) for m in fusion_core.get_fusion_plan(again).modules] == paths
    assert fusion_core.get_fusion_plan(explicit_off) is None


def test_an_unknown_family_is_refused_naming_the_plugin_never_handed_to_transformers(llama):
    with fusion_core.integrate_transformers(), pytest.raises(ValidationError, match="pip install fusion-no-such"):
        AutoModelForCausalLM.from_pretrained(llama, fusion_config={"no_such_family": True})


def test_nesting_and_switching_off(llama):
    original = transformers.PreTrainedModel.__dict__["from_pretrained"]
    with fusion_core.integrate_transformers():
        with fusion_core.integrate_transformers():
            assert is_integrated()
        assert is_integrated()  # the outer block still holds it
        with fusion_core.integrate_transformers(False):
            assert not is_integrated()
            assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original
        assert is_integrated()
    assert not is_integrated()
    assert transformers.PreTrainedModel.__dict__["from_pretrained"] is original
    fusion_core.integrate_transformers()
    fusion_core.integrate_transformers()
    fusion_core.integrate_transformers(False)  # off, however often it was switched on
    assert not is_integrated() and transformers.PreTrainedModel.__dict__["from_pretrained"] is original


def _in_turns(*steps: tuple[int, Callable[[], None]]) -> None:
    """Run each ``(thread, step)`` in the order given, thread 0 or 1 doing its own steps; re-raise a failed step."""
    turn = [threading.Event() for _ in steps] + [threading.Event()]
    errors: list[BaseException] = []

    def play(thread: int) -> None:
        for i, (who, step) in enumerate(steps):
            if who != thread:
                continue
            if not turn[i].wait(timeout=10):
                errors.append(TimeoutError(f"thread {thread}: step {i} never came"))
                return
            try:
                step()
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)
            finally:
                turn[i + 1].set()

    threads = [threading.Thread(target=play, args=(n,)) for n in (0, 1)]
    for thread in threads:
        thread.start()
    turn[0].set()
    for thread in threads:
        thread.join(timeout=20)
    if errors:
        raise errors[0]


def test_a_thread_leaving_its_block_never_switches_off_another_threads_block():
    """Thread 0 enters, thread 1 enters, thread 0 leaves: thread 1 is still inside its block, so routing stays on."""
    original = transformers.PreTrainedModel.__dict__["from_pretrained"]
    blocks: dict[int, TransformersIntegration] = {}
    seen: list[bool] = []

    def enter(thread: int) -> Callable[[], None]:
        return lambda: blocks.__setitem__(thread, fusion_core.integrate_transformers().__enter__())

    def leave(thread: int) -> Callable[[], None]:
        return lambda: blocks[thread].__exit__(None, None, None)

    def look() -> None:
        seen.append(is_integrated() and transformers.PreTrainedModel.__dict__["from_pretrained"] is not original)

    _in_turns((0, enter(0)), (1, enter(1)), (0, leave(0)), (1, look), (1, leave(1)))
    assert seen == [True], "thread 0 leaving its block switched routing off inside thread 1's block"
    assert not is_integrated() and transformers.PreTrainedModel.__dict__["from_pretrained"] is original


def test_a_switch_off_block_gives_back_only_the_activations_still_held():
    """Thread 1 switches off inside thread 0's block; thread 0 leaves first; leaving the off block turns nothing on.

    And the other way round: an off block left while the activation it took back is still held gives it back.
    """
    blocks: dict[str, TransformersIntegration] = {}
    seen: dict[str, bool] = {}

    def enter(name: str, enable: bool) -> Callable[[], None]:
        return lambda: blocks.__setitem__(name, fusion_core.integrate_transformers(enable).__enter__())

    def leave(name: str) -> Callable[[], None]:
        return lambda: blocks[name].__exit__(None, None, None)

    def look(name: str) -> Callable[[], None]:
        return lambda: seen.__setitem__(name, is_integrated())

    _in_turns((0, enter("on", True)), (1, enter("off", False)), (0, look("inside off")), (0, leave("on")),
              (1, leave("off")), (1, look("after both")))
    _in_turns((0, enter("on", True)), (1, enter("off", False)), (1, leave("off")), (0, look("off left")),
              (0, leave("on")))
    assert seen == {"inside off": False, "after both": False, "off left": True}
    assert not is_integrated()


def test_fusion_core_from_pretrained_while_integrated_does_not_recurse(llama):
    plain = AutoModelForCausalLM.from_pretrained(llama)
    with fusion_core.integrate_transformers():
        model = fusion_core.from_pretrained(AutoModelForCausalLM, llama, fusion_config=QKV)
    _assert_fused_like_plain(model, plain)


def test_activation_is_process_wide_and_each_thread_gets_its_own_load(llama):
    """Routed fused loads in threads beside plain ones. On 4.57 the plain ones go through fusion-core without a
    fusion_config, which serializes them with the fused loads: transformers 4.57 itself cannot load in two threads
    at once (see tests/test_reliability_concurrency.py)."""
    plain = AutoModelForCausalLM.from_pretrained(llama)
    results: dict[str, torch.nn.Module] = {}
    errors: list[BaseException] = []

    def load(name: str, fusion: bool) -> None:
        try:
            if fusion:
                results[name] = AutoModelForCausalLM.from_pretrained(llama, fusion_config=QKV)
            elif TF5:
                results[name] = AutoModelForCausalLM.from_pretrained(llama)
            else:  # 4.57's own loads are not thread-safe (init_empty_weights patches the process): serialize them
                results[name] = fusion_core.from_pretrained(AutoModelForCausalLM, llama)
        except BaseException as exc:  # reported below
            errors.append(exc)

    with fusion_core.integrate_transformers():
        threads = [threading.Thread(target=load, args=(f"t{i}", i % 2 == 0)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    for i in range(4):
        model = results[f"t{i}"]
        if i % 2 == 0:
            _assert_fused_like_plain(model, plain)
        else:
            assert fusion_core.get_fusion_plan(model) is None


def _save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer (w0 ... wN) saved beside the checkpoint, so ``pipeline`` can load it by path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", pad_token="w0",
                                                eos_token="w2", bos_token="w1")
    fast.save_pretrained(directory)


def test_pipeline_with_model_kwargs_loads_fused(llama, tmp_path):
    import shutil

    directory = tmp_path / "with-tokenizer"
    shutil.copytree(llama, directory)
    vocab_size = AutoModelForCausalLM.from_pretrained(llama).config.vocab_size
    _save_word_tokenizer(directory, vocab_size)
    plain = transformers.pipeline("text-generation", model=str(directory))
    with fusion_core.integrate_transformers():
        fused = transformers.pipeline("text-generation", model=str(directory), model_kwargs={"fusion_config": QKV})
    assert fusion_core.get_fusion_plan(fused.model) is not None
    prompt = "w5 w9 w17 w3"
    kwargs = {"max_new_tokens": 6, "do_sample": False}
    assert fused(prompt, **kwargs)[0]["generated_text"] == plain(prompt, **kwargs)[0]["generated_text"]


TRAINER_SCRIPT = textwrap.dedent("""
    # A Trainer script as users write it: the model is loaded by name with load keyword arguments.
    import sys, torch, transformers
    import fusion_core

    source, out = sys.argv[1], sys.argv[2]
    fusion_core.integrate_transformers()
    model_kwargs = {"fusion_config": {"qkv": True, "gate_up": True}}
    model = transformers.AutoModelForCausalLM.from_pretrained(source, **model_kwargs)
    assert fusion_core.get_fusion_plan(model) is not None, "not fused"
    ids = torch.randint(3, 100, (8, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=out + "/run", per_device_train_batch_size=4, max_steps=2,
                                          learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                                          logging_steps=1, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(out + "/model")
    print("loss", trainer.state.log_history[-1]["train_loss"])
""")


@pytest.mark.slow
def test_a_trainer_script_trains_the_fused_model_and_saves_the_original_layout(llama, tmp_path):
    from safetensors.torch import load_file

    script = tmp_path / "train.py"
    script.write_text(TRAINER_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(llama), str(tmp_path)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = load_file(tmp_path / "model" / "model.safetensors")
    source = load_file(llama / "model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in source.items()}
    assert any(not torch.equal(saved[k], source[k]) for k in source)  # trained, in the original layout
