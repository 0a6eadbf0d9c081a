"""linear_cross_entropy: the training loss and every gradient equal the plain model's; nothing else changes.

Each architecture is a tiny random model built from its real transformers config class, saved with
``save_pretrained`` and loaded both plainly and through fusion-core. The LM head's weight is drawn
at unit scale so the logits are O(1-10): soft-capping, logit scaling and the float32 upcast then
matter to the result.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from fusion_linear_cross_entropy import DeferredLogits, LinearCrossEntropyFamily, LinearCrossEntropyMixin
from fusion_linear_cross_entropy.deferred import Source
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from transformers import AutoModel, AutoModelForCausalLM

import fusion_core
from fusion_core.testing import kit
from fusion_core.testing.kit import relative_l2

FAMILY = LinearCrossEntropyFamily()
ON = {"linear_cross_entropy": True}
VOCAB = 256
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2048)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 3.0}),
    "cohere": ("CohereConfig", {"logit_scale": 0.5}),
    "granite": ("GraniteConfig", {"logits_scaling": 2.0, "tie_word_embeddings": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
                                  "router_aux_loss_coef": 0.5}),
}
FP32 = (1e-5, 1e-5)  # loss relative error, gradient relative L2 error
BF16 = (1e-3, 1e-2)


def _config(name: str) -> Any:
    class_name, extra = ARCHITECTURES[name]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return config_class(**COMMON, **extra)


@pytest.fixture(scope="module")
def checkpoints(checkpoint_of: Any) -> Any:
    """``checkpoint(name)``: the directory of the tiny ``name`` model, built once per module."""
    return lambda name: checkpoint_of(name, lambda: _config(name))


def _load(path: Path, fusion_config: Any = None, **kwargs: Any) -> nn.Module:
    if fusion_config is None:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=fusion_config, **kwargs)


def _inputs(batch: int = 2, tokens: int = 13, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=generator)
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt
    labels[-1, -3] = -100
    return {"input_ids": ids, "labels": labels}


def _step(model: nn.Module, **inputs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """One training forward and backward: the output and every parameter's gradient."""
    model.train()
    model.zero_grad(set_to_none=True)
    output = model(**inputs)
    loss = output[0] if isinstance(output, tuple) else output.loss
    loss.backward()
    return output, {n.removeprefix("_orig_mod."): p.grad.detach().clone()
                    for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_training(plain: nn.Module, fused: nn.Module, tolerance: tuple[float, float] = FP32,
                          **inputs: Any) -> tuple[Any, Any]:
    expected, expected_grads = _step(plain, **inputs)
    got, got_grads = _step(fused, **inputs)
    expected_loss = expected[0] if isinstance(expected, tuple) else expected.loss
    got_loss = got[0] if isinstance(got, tuple) else got.loss
    assert relative_l2(expected_loss, got_loss) <= tolerance[0], (float(got_loss), float(expected_loss))
    assert sorted(got_grads) == sorted(expected_grads)
    errors = {n: relative_l2(g, got_grads[n]) for n, g in expected_grads.items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tolerance[1], f"gradient of {worst}: relative L2 error {errors[worst]:.3g}"
    return expected, got


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_loss_and_every_gradient_match_float32(checkpoints, name):
    path = checkpoints(name)
    plain, fused = _load(path), _load(path, {"linear_cross_entropy": {"chunk_tokens": 7}})
    assert isinstance(fused, LinearCrossEntropyMixin) and type(fused).__name__ == type(plain).__name__
    expected, got = _assert_same_training(plain, fused, **_inputs())
    assert got.logits is None and isinstance(expected.logits, torch.Tensor)
    if name == "mixtral":  # the router's auxiliary loss is in both losses
        assert got.aux_loss is not None and torch.allclose(got.aux_loss, expected.aux_loss)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "cohere", "granite", "mixtral"])
def test_loss_and_every_gradient_match_bfloat16(checkpoints, name):
    path = checkpoints(name)
    plain = _load(path, dtype=torch.bfloat16)
    fused = _load(path, {"linear_cross_entropy": {"chunk_tokens": 5}}, dtype=torch.bfloat16)
    assert next(fused.parameters()).dtype == torch.bfloat16
    _assert_same_training(plain, fused, BF16, **_inputs())


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_long_batch_bfloat16_head_weight_gradient_is_one_gemm_per_element(checkpoints, name):
    """Made by blocks of the vocabulary over all 1400 rows, each element is rounded once, as plain's. The sum of
    22 chunks' bf16 GEMMs (what a head behind a vocabulary slice still gets) was 3.1e-3 and 4.1e-3 off plain here;
    by blocks, 1.7e-4 at most."""
    path = checkpoints(name)
    plain = _load(path, dtype=torch.bfloat16)
    fused = _load(path, {"linear_cross_entropy": {"chunk_tokens": 64}}, dtype=torch.bfloat16)
    _assert_same_training(plain, fused, BF16, **_inputs(tokens=700))  # leaves the step's gradients in place
    expected, got = (model.get_output_embeddings().weight.grad for model in (plain, fused))
    assert relative_l2(expected, got) <= 1e-3


def test_long_batch_bfloat16_sums_weight_gradients_in_float32():
    """A vocabulary slice between the head and the loss keeps the chunks' sum, flushed to float32 (FLUSH_ROWS)."""
    torch.manual_seed(0)
    plain = PaddedVocabularyLlama(_config("llama")).to(torch.bfloat16)
    fused = fusion_core.fuse(copy.deepcopy(plain), {"linear_cross_entropy": {"chunk_tokens": 64}})
    inputs = _inputs(tokens=700)  # 1400 rows: 22 chunks, past FLUSH_ROWS
    inputs["labels"] = inputs["labels"].clamp(max=VOCAB - 57)
    _assert_same_training(plain, fused, BF16, **inputs)


def test_autocast(checkpoints):
    path = checkpoints("gemma2")
    plain, fused = _load(path), _load(path, {"linear_cross_entropy": {"chunk_tokens": 5}})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same_training(plain, fused, BF16, **_inputs())


def test_conformance_kit_checks_the_declaration(tmp_path):
    assert FAMILY.preserves == "training_loss"
    kit.assert_options_schema(FAMILY)
    kit.assert_fused_load(FAMILY, (transformers.LlamaForCausalLM, _config("llama")), tmp_path)


def test_num_items_in_batch_tensor_and_int(checkpoints):
    path = checkpoints("llama")
    plain, fused = _load(path), _load(path, ON)
    for items in (torch.tensor(37), 11):
        _assert_same_training(plain, fused, **_inputs(), num_items_in_batch=items)


def test_all_tokens_but_a_few_ignored(checkpoints):
    path = checkpoints("qwen2")
    plain, fused = _load(path), _load(path, {"linear_cross_entropy": {"chunk_tokens": 2}})
    inputs = _inputs()
    inputs["labels"][:, :-2] = -100
    _assert_same_training(plain, fused, **inputs)


def test_shift_labels(checkpoints):
    path = checkpoints("llama")
    plain, fused = _load(path), _load(path, ON)
    inputs = _inputs()
    shifted = F.pad(inputs["labels"], (0, 1), value=-100)[..., 1:].contiguous()
    shifted[1, 2] = -100
    try:
        _step(plain, **inputs, shift_labels=shifted)
    except TypeError as exc:  # a transformers release whose forward does not pass it through
        pytest.skip(f"shift_labels not accepted: {exc}")
    _assert_same_training(plain, fused, **inputs, shift_labels=shifted)


def test_tuple_output(checkpoints):
    path = checkpoints("qwen2")
    plain, fused = _load(path), _load(path, ON)
    expected, got = _assert_same_training(plain, fused, **_inputs(), return_dict=False)
    assert isinstance(got, tuple) and got[1] is None and len(got) == len(expected)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_eval_mode_no_labels_and_no_grad_run_the_original_forward(checkpoints, name):
    path = checkpoints(name)
    plain, fused = _load(path), _load(path, ON)
    inputs = _inputs()
    for mode in ("eval", "train"):
        plain.train(mode == "train"), fused.train(mode == "train")
        with torch.no_grad():
            assert torch.equal(fused(input_ids=inputs["input_ids"]).logits, plain(input_ids=inputs["input_ids"]).logits)
            expected, got = plain(**inputs), fused(**inputs)  # labels, but no grad: the original forward
        assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)
    plain.eval(), fused.eval()
    expected, got = plain(**inputs), fused(**inputs)  # eval mode, grad enabled: the original forward
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)


def test_several_chunks_equal_one_chunk(checkpoints):
    path = checkpoints("gemma2")
    one = _load(path, {"linear_cross_entropy": {"chunk_tokens": 10_000}})
    many = _load(path, {"linear_cross_entropy": {"chunk_tokens": 3}})
    _assert_same_training(one, many, (1e-6, 1e-6), **_inputs(tokens=17))


def test_default_chunk_is_sized_by_the_vocabulary():
    from fusion_linear_cross_entropy.loss import chunk_rows

    assert chunk_rows(151936, None) == 256 and chunk_rows(128256, None) == 256 and chunk_rows(256000, None) == 128
    assert chunk_rows(256, None) == 131072 and chunk_rows(256, 9) == 9 and chunk_rows(10**7, None) == 128


def test_return_logits(checkpoints):
    path = checkpoints("cohere")
    plain = _load(path)
    fused = _load(path, {"linear_cross_entropy": {"chunk_tokens": 4, "return_logits": True}})
    expected, got = _assert_same_training(plain, fused, **_inputs())
    assert not isinstance(got.logits, DeferredLogits) and not got.logits.requires_grad
    torch.testing.assert_close(got.logits, expected.logits.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("modules_to_save", [False, True])
def test_lora(checkpoints, modules_to_save):
    peft = pytest.importorskip("peft")
    path = checkpoints("llama")
    targets = ["q_proj", "v_proj"] + ([] if modules_to_save else ["lm_head"])
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
                             modules_to_save=["lm_head"] if modules_to_save else None)
    models = []
    for fusion in (None, ON):
        torch.manual_seed(3)
        models.append(peft.get_peft_model(_load(path, fusion), copy.deepcopy(config)))
    plain, fused = models
    _, got = _assert_same_training(plain, fused, **_inputs())
    assert got.logits is None
    grads = [n for n, p in fused.named_parameters() if p.grad is not None]
    assert any("lm_head" in n for n in grads) and all(p.grad is None for n, p in fused.named_parameters()
                                                         if "lora" not in n and "modules_to_save" not in n)


def test_gradient_checkpointing(checkpoints):
    path = checkpoints("qwen2")
    plain, fused = _load(path), _load(path, {"linear_cross_entropy": {"chunk_tokens": 6}})
    for model in (plain, fused):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _assert_same_training(plain, fused, **_inputs())


def test_torch_compile(checkpoints):
    path = checkpoints("llama")
    plain, fused = _load(path), _load(path, ON)
    torch.compiler.reset()
    try:
        _assert_same_training(plain, torch.compile(fused, backend="aot_eager"), **_inputs())
        # Inference is traced whole: the fused forward adds no graph break there.
        fused.eval()
        with torch.no_grad():
            got = torch.compile(fused, backend="aot_eager", fullgraph=True)(input_ids=_inputs()["input_ids"]).logits
            assert torch.allclose(got, plain.eval()(input_ids=_inputs()["input_ids"]).logits, atol=1e-5)
    finally:
        torch.compiler.reset()


def test_composes_with_qkv_and_gate_up(checkpoints):
    path = checkpoints("llama")
    plain = _load(path)
    fused = _load(path, {"qkv": True, "gate_up": True, "linear_cross_entropy": {"chunk_tokens": 5}})
    families = set(fusion_core.get_fusion_plan(fused).families)
    assert families == {"qkv", "gate_up", "linear_cross_entropy"}
    expected, expected_grads = _step(plain, **_inputs())
    got, got_grads = _step(fused, **_inputs())
    assert relative_l2(expected.loss, got.loss) <= 1e-5 and got.logits is None
    shared = sorted(set(expected_grads) & set(got_grads))
    assert "lm_head.weight" in shared and "model.embed_tokens.weight" in shared
    for name in shared:
        assert relative_l2(expected_grads[name], got_grads[name]) <= 1e-5, name
    norm = sum(float(g.float().square().sum()) for g in expected_grads.values()) ** 0.5
    got_norm = sum(float(g.float().square().sum()) for g in got_grads.values()) ** 0.5
    assert abs(got_norm - norm) <= 1e-5 * norm


def test_save_writes_the_source_checkpoint_and_unfuse_restores_the_class(checkpoints, tmp_path):
    path = checkpoints("qwen2")
    fused = _load(path, ON)
    _step(fused, **_inputs())  # a training step changes no tensor layout
    fusion_core.save_pretrained(fused, tmp_path / "saved")
    source, saved = load_file(path / "model.safetensors"), load_file(tmp_path / "saved" / "model.safetensors")
    assert sorted(saved) == sorted(source)
    for key, tensor in source.items():
        assert saved[key].dtype == tensor.dtype and saved[key].shape == tensor.shape
        assert saved[key].contiguous().view(torch.uint8).equal(tensor.contiguous().view(torch.uint8)), key
    plain_class = type(_load(path))
    fusion_core.unfuse(fused)
    assert type(fused) is plain_class and fusion_core.get_fusion_plan(fused) is None
    output, _ = _step(fused, **_inputs())
    assert isinstance(output.logits, torch.Tensor)


def test_forward_keeps_the_original_signature(checkpoints):
    import inspect

    fused = _load(checkpoints("llama"), ON)
    plain = transformers.LlamaForCausalLM(_config("llama"))
    assert inspect.signature(fused.forward) == inspect.signature(plain.forward)
    assert "logits_to_keep" in inspect.signature(fused.forward).parameters  # generate() keeps only the last logits


def test_a_loss_function_set_by_the_user_runs_the_original_forward(checkpoints):
    path = checkpoints("llama")
    plain, fused = _load(path), _load(path, ON)
    for model in (plain, fused):
        model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.float().square().mean()
    with pytest.warns(UserWarning, match="original forward"):
        expected, got = _assert_same_training(plain, fused, **_inputs())
    assert torch.equal(got.logits, expected.logits)


def test_fused_model_pickles_with_its_options(checkpoints):
    path = checkpoints("llama")
    fused = _load(path, {"linear_cross_entropy": {"chunk_tokens": 3, "return_logits": True}})
    copied = pickle.loads(pickle.dumps(fused))
    assert type(copied) is type(fused) and type(copied).chunk_tokens == 3 and type(copied).return_logits
    assert type(copy.deepcopy(fused)) is type(fused)


def test_a_headless_model_is_refused(checkpoints, caplog):
    path = checkpoints("llama")
    with pytest.raises(fusion_core.DiscoveryError, match="no output embeddings"):
        fusion_core.from_pretrained(AutoModel, path, fusion_config=ON)
    model = fusion_core.from_pretrained(AutoModel, path, fusion_config={"linear_cross_entropy": {"required": False}})
    assert not isinstance(model, LinearCrossEntropyMixin) and "no output embeddings" in caplog.text


class ManualLossLlama(transformers.LlamaForCausalLM):
    """Computes its loss itself, not with ``self.loss_function``."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class SortingLlama(transformers.LlamaForCausalLM):
    """Applies a non-elementwise op to its logits before ``self.loss_function``."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        logits = logits.sort(dim=-1).values
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_forward_without_loss_function_is_refused():
    with torch.device("meta"):
        model = ManualLossLlama(_config("llama"))
    options = FAMILY.options_model()
    reason = FAMILY.refusal(model, options)
    assert reason is not None and "self.loss_function" in reason and not FAMILY.is_fusable(model, options)
    with torch.device("meta"):
        assert FAMILY.refusal(transformers.LlamaForCausalLM(_config("llama")), FAMILY.options_model()) is None
    torch.manual_seed(0)
    with pytest.raises(fusion_core.DiscoveryError, match="self.loss_function"):
        fusion_core.fuse(ManualLossLlama(_config("llama")), ON)


def test_the_forward_source_is_read_once_per_class(monkeypatch):
    """``is_fusable`` and ``refusal`` both ask at every load; the forward's source is parsed once per class."""
    from fusion_linear_cross_entropy import family

    class OncePerClassLlama(transformers.LlamaForCausalLM):
        pass

    reads, forwards = [], family.forwards
    monkeypatch.setattr(family, "forwards", lambda cls: reads.append(cls) or forwards(cls))
    with torch.device("meta"):
        model = OncePerClassLlama(_config("llama"))
    options = FAMILY.options_model()
    assert FAMILY.is_fusable(model, options) and FAMILY.refusal(model, options) is None
    assert FAMILY.refusal(model, options) is None
    assert reads == [OncePerClassLlama]


class ShiftingLlama(transformers.LlamaForCausalLM):
    """Shifts its logits by hand before ``self.loss_function`` (transformers 4.57's Moshi does)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = None
        if labels is not None:
            logits = logits.float()
            shift_logits = logits[..., :-1, :].contiguous()
            loss = self.loss_function(shift_logits.view(-1, self.config.vocab_size), labels[..., 1:].reshape(-1),
                                      vocab_size=self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_forward_that_indexes_its_logits_is_declined_at_plan_time():
    with torch.device("meta"):
        model = ShiftingLlama(_config("llama"))
    reason = FAMILY.refusal(model, FAMILY.options_model())
    assert reason is not None and "indexes its logits (logits[..., :-1, :])" in reason
    torch.manual_seed(0)
    with pytest.raises(fusion_core.DiscoveryError, match=r"indexes its logits"):
        fusion_core.fuse(ShiftingLlama(_config("llama")), ON)


class PaddedVocabularyLlama(transformers.LlamaForCausalLM):
    """Drops the padding rows of its head's vocabulary before ``self.loss_function`` (Inkling does)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        logits = logits[..., : self.config.vocab_size - 56]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits * 0.5, labels=labels, vocab_size=logits.shape[-1])
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_slice_of_the_vocabulary_is_replayed_chunk_by_chunk():
    torch.manual_seed(0)
    plain = PaddedVocabularyLlama(_config("llama"))
    assert FAMILY.refusal(plain, FAMILY.options_model()) is None
    fused = fusion_core.fuse(copy.deepcopy(plain), {"linear_cross_entropy": {"chunk_tokens": 5}})
    inputs = _inputs()
    inputs["labels"] = inputs["labels"].clamp(max=VOCAB - 57)
    _assert_same_training(plain, fused, **inputs)
    deferred = DeferredLogits.make(Source(torch.zeros(1, 4), nn.Identity(), lambda h: h, "M"), (), (2, 3, 10),
                                   torch.float32, torch.device("cpu"))
    with pytest.raises(fusion_core.FusionError, match=r"M's forward indexes its logits with \(Ellipsis, slice"):
        deferred[..., :-1, :]


@pytest.mark.parametrize(("line", "declined"), [
    ("logits = logits[..., :n]", False), ("logits = logits[:, :, :n]", False), ("logits = logits[..., 2:n:1]", False),
    ("logits = logits[..., :-1, :]", True), ("logits = logits[:, -1]", True), ("logits = logits[..., ::2]", True),
])
def test_the_plan_time_reading_accepts_the_slices_the_placeholder_replays(line, declined):
    import ast

    from fusion_linear_cross_entropy.family import _indexed_logits

    tree = ast.parse(f"def forward(self, h):\n    logits = self.lm_head(h)\n    {line}\n    return logits\n")
    assert (_indexed_logits(tree, "lm_head") is not None) is declined
    index = eval(f"(lambda logits, n: {line.split(' = ')[1]})", {"__builtins__": {}})
    deferred = DeferredLogits.make(Source(torch.zeros(1, 4), nn.Identity(), lambda h: h, "M"), (), (2, 3, 10),
                                   torch.float32, torch.device("cpu"))
    if declined:
        with pytest.raises(fusion_core.FusionError):
            index(deferred, 7)
    else:
        assert index(deferred, 7).shape[:-1] == (2, 3)


def test_an_op_the_family_cannot_replay_fails_by_name():
    torch.manual_seed(0)
    model = fusion_core.fuse(SortingLlama(_config("llama")), ON)
    assert isinstance(model, LinearCrossEntropyMixin)
    model.train()
    with pytest.raises(fusion_core.FusionError, match=r"SortingLlama.*sort"):
        model(**_inputs())
    assert "forward" not in model.lm_head.__dict__  # the head is restored on the way out
    model.eval()
    with torch.no_grad():
        assert model(**_inputs()).logits.shape == (2, 13, VOCAB)


def test_only_ops_on_each_logit_alone_let_the_head_gradient_go_by_vocabulary_blocks():
    deferred = DeferredLogits.make(Source(torch.zeros(1, 4), nn.Identity(), lambda h: h, "M"), (), (2, 3, 10),
                                   torch.bfloat16, torch.device("cpu"))
    scaled = torch.tanh(deferred.float() / 3.0) * torch.tensor(3.0)
    assert scaled.acts_per_logit() and scaled.to(torch.ones(2, 2)).acts_per_logit()  # a .to(tensor) is a conversion
    assert not (deferred + torch.arange(10.0)).acts_per_logit()  # an operand along the vocabulary
    assert not deferred[..., :7].acts_per_logit()  # a slice of it
