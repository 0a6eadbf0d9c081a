"""linear_cross_entropy in what fine-tuners run: Trainer, TRL's SFTTrainer, PEFT LoRA, the other families, DDP, FSDP2.

Every test trains the fused model and the plain one the same way (same checkpoint, same seed, same batches) and
compares them: the losses (relative error), and the *updates* of every trained tensor (relative L2 of
``trained - initial``, so a gradient error is not hidden behind the weights' own size). SGD, not AdamW: the first
AdamW steps move each weight by about ``lr * sign(grad)``, which would hide gradient errors. The tiny models are
real transformers architectures (``fusion_core.testing.tiny_models``) saved to a temporary directory, their LM
head drawn at unit scale so the logits are O(1-10) and the loss is not ``log(vocab)`` everywhere.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from fusion_linear_cross_entropy import LinearCrossEntropyMixin, family
from torch import nn
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import fusion_core
from fusion_core.testing.decisions import fake_clock, original_slowest
from fusion_core.testing.distributed import run_job
from fusion_core.testing.kit import relative_l2
from fusion_core.testing.tiny_models import MOE_MODELS, TEXT_MODELS

LOSS_TOLERANCE = 1e-5  # float32: relative error of a loss
UPDATE_TOLERANCE = 1e-5  # float32: relative L2 error of a trained weight, and of all weight updates together
TENSOR_UPDATE_TOLERANCE = 1e-3  # float32: relative L2 error of one tensor's update (see _assert_same_updates)
VOCAB = 128  # the tiny models' (TEXT_MODELS, MOE_MODELS)
TF5 = int(transformers.__version__.split(".")[0]) >= 5
CHUNKED = {"linear_cross_entropy": {"chunk_tokens": 5}}  # several chunks per batch


# -- checkpoints, models, comparisons -----------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(checkpoint_of: Any) -> Any:
    """``checkpoint(name)``: the directory of a tiny model (a TEXT_MODELS or MOE_MODELS name), built once."""
    return lambda name: checkpoint_of(name, {**TEXT_MODELS, **MOE_MODELS}[name].make_config)


def _load(path: Path, fusion_config: Any = None) -> Any:
    if fusion_config is None:
        return AutoModelForCausalLM.from_pretrained(path)
    return fusion_core.from_pretrained(AutoModelForCausalLM, path, fusion_config=fusion_config)


def _state(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The trained tensors by name (the checkpoint's names: a fused model's state_dict has the original layout)."""
    if trainable_only:
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _assert_same_losses(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected) and expected
    errors = [abs(a - b) / abs(b) for a, b in zip(got, expected, strict=True)]
    assert max(errors) <= LOSS_TOLERANCE, f"fused {got} vs plain {expected}"


def _assert_same_updates(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         initial: dict[str, torch.Tensor]) -> None:
    """The fused training moved the weights as the plain one did.

    - every updated tensor within ``UPDATE_TOLERANCE`` (relative L2) of plain's;
    - the update of all trained tensors together (``trained - initial``, concatenated) within ``UPDATE_TOLERANCE``;
    - each tensor's own update within ``TENSOR_UPDATE_TOLERANCE``: a tensor that got no gradient, or a wrong one,
      is off by O(1). Not 1e-5 there: a few SGD steps of a model this small are ill-conditioned per tensor (plain
      float32 against the same training in float64 differs by up to 3e-3 in one tensor's update, by 1e-5 in all
      together), and the head's weight gradient, summed over chunks in another order, differs in its last bits;
    - a tensor plain's training left alone, the fused one left alone.
    """
    assert sorted(got) == sorted(expected)
    moved = [k for k in expected if not torch.equal(expected[k], initial[k])]
    assert moved, "the plain training moved nothing"
    weights = {k: relative_l2(expected[k], got[k]) for k in moved}
    worst = max(weights, key=weights.__getitem__)
    assert weights[worst] <= UPDATE_TOLERANCE, f"updated {worst}: relative L2 error {weights[worst]:.3g}"
    updates = {k: relative_l2(expected[k] - initial[k], got[k] - initial[k]) for k in moved}
    worst = max(updates, key=updates.__getitem__)
    assert updates[worst] <= TENSOR_UPDATE_TOLERANCE, f"update of {worst}: relative L2 error {updates[worst]:.3g}"
    together = relative_l2(torch.cat([(expected[k] - initial[k]).flatten() for k in moved]),
                           torch.cat([(got[k] - initial[k]).flatten() for k in moved]))
    assert together <= UPDATE_TOLERANCE, f"update of all trained tensors: relative L2 error {together:.3g}"
    still = [k for k in expected if k not in moved and not torch.equal(got[k], initial[k])]
    assert not still, f"moved in the fused training only: {still}"


@pytest.fixture
def fused_losses(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every chunked loss the family computes (so a test knows its path ran)."""
    calls: list[dict[str, Any]] = []
    chunked = family.chunked_causal_lm_loss

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return chunked(*args, **kwargs)

    monkeypatch.setattr(family, "chunked_causal_lm_loss", spy)
    return calls


def _token_dataset(rows: int, tokens: int = 12, seed: int = 0) -> Any:
    """Random token ids with labels: a masked prompt per row, and one row mostly masked."""
    datasets = pytest.importorskip("datasets")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, tokens), generator=generator)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[1, 5:] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


class RecordingTrainer(Trainer):
    """A Trainer that keeps the loss of every micro-batch (the logged loss is rounded to 4 digits on 4.57)."""

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.micro_losses = [*getattr(self, "micro_losses", []), float(loss)]
        return loss


def _arguments(output_dir: Path, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=str(output_dir), per_device_train_batch_size=2, per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, max_steps=3, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=7, disable_tqdm=True,
        dataloader_num_workers=0,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def _logged_losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _assert_same_logged_losses(got: list[float], expected: list[float]) -> None:
    """Per-step logged losses: 4.57 rounds them to 4 decimals, so a rounding boundary may split them by 1e-4."""
    assert len(got) == len(expected) and expected
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= (1e-4 if not TF5 else LOSS_TOLERANCE * abs(b)), (got, expected)


# -- 1. Trainer ---------------------------------------------------------------------------------------------
def _train_with_trainer(path: Path, fusion_config: Any, tmp_path: Path, **overrides: Any) -> tuple[Any, Any]:
    model = _load(path, fusion_config)
    trainer = RecordingTrainer(model=model, args=_arguments(tmp_path / str(bool(fusion_config)), **overrides),
                               train_dataset=_token_dataset(12))
    trainer.train()
    return trainer, model


def test_trainer_gradient_accumulation_passes_num_items_and_trains_like_plain(checkpoints, tmp_path, fused_losses):
    """``gradient_accumulation_steps=2``: Trainer passes ``num_items_in_batch`` (the tokens of both micro-batches)
    to the model, which the chunked loss divides by; per-micro-batch and logged losses and the trained weights are
    the plain model's."""
    path = checkpoints("llama")
    initial = _state(_load(path))
    plain, plain_model = _train_with_trainer(path, None, tmp_path)
    fused, fused_model = _train_with_trainer(path, CHUNKED, tmp_path)
    assert isinstance(fused_model, LinearCrossEntropyMixin) and fused.model_accepts_loss_kwargs
    assert len(fused_losses) == 6 and all(call.get("num_items_in_batch") is not None for call in fused_losses)
    _assert_same_losses(fused.micro_losses, plain.micro_losses)
    _assert_same_logged_losses(_logged_losses(fused), _logged_losses(plain))
    _assert_same_updates(_state(fused_model), _state(plain_model), initial)


def test_trainer_resumes_from_a_checkpoint_of_a_fused_run(checkpoints, tmp_path, fused_losses):
    """``train(resume_from_checkpoint=...)``: a fused run saved at step 2 (the model in its original layout, AdamW's
    state of the fused parameters) and resumed in a freshly loaded fused model ends where the uninterrupted fused
    run ends, which trained like plain."""
    path = checkpoints("llama")
    families = {**CHUNKED, "qkv": True, "gate_up": True}
    settings = dict(optim="adamw_torch", max_steps=4, save_strategy="steps", save_steps=2,
                    gradient_accumulation_steps=1, learning_rate=1e-2)
    initial = _state(_load(path))
    _, plain_model = _train_with_trainer(path, None, tmp_path, **settings)
    fused, fused_model = _train_with_trainer(path, families, tmp_path, **settings)
    _assert_same_updates(_state(fused_model), _state(plain_model), initial)
    checkpoint = Path(fused.args.output_dir) / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed_model = _load(path, families)
    resumed = RecordingTrainer(model=resumed_model, args=_arguments(tmp_path / "resumed", **settings),
                               train_dataset=_token_dataset(12))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4 and len(resumed.micro_losses) == 2
    _assert_same_losses(resumed.micro_losses, fused.micro_losses[2:])
    for name, tensor in _state(fused_model).items():
        torch.testing.assert_close(_state(resumed_model)[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def test_trainer_label_smoothing_gets_the_logits(checkpoints, tmp_path, fused_losses):
    """``label_smoothing_factor``: Trainer pops the labels and smooths the loss itself from the logits; called
    without labels, the fused model runs the original forward and returns them."""
    path = checkpoints("llama")
    initial = _state(_load(path))
    plain, plain_model = _train_with_trainer(path, None, tmp_path, label_smoothing_factor=0.1)
    fused, fused_model = _train_with_trainer(path, CHUNKED, tmp_path, label_smoothing_factor=0.1)
    assert fused.label_smoother is not None and not fused_losses  # the family's loss never ran
    _assert_same_losses(fused.micro_losses, plain.micro_losses)
    _assert_same_updates(_state(fused_model), _state(plain_model), initial)


def test_trainer_evaluate_predict_and_compute_metrics_see_plain_logits(checkpoints, tmp_path, fused_losses):
    """Eval mode runs the original forward: ``evaluate`` (with ``compute_metrics``) and ``predict`` give the plain
    model's loss, metrics and logits bit for bit; after a training of both, within the tolerance."""
    path = checkpoints("qwen2")
    eval_set = _token_dataset(6, seed=1)
    seen: dict[str, list[Any]] = {"plain": [], "fused": []}

    def metrics_of(side: str) -> Any:
        def compute_metrics(prediction: Any) -> dict[str, float]:
            logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
            seen[side].append(logits)
            counted = labels[:, 1:] != -100
            hits = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & counted
            return {"accuracy": float(hits.sum() / counted.sum())}

        return compute_metrics

    results: dict[str, Any] = {}
    for side, fusion in (("plain", None), ("fused", CHUNKED)):
        model = _load(path, fusion)
        trainer = RecordingTrainer(model=model, args=_arguments(tmp_path / side, max_steps=2),
                                   train_dataset=_token_dataset(8), eval_dataset=eval_set,
                                   compute_metrics=metrics_of(side))
        before = trainer.evaluate()
        predicted = trainer.predict(eval_set)
        trainer.train()
        after = trainer.evaluate()
        results[side] = (before, predicted, after)
    (before, predicted, after), (plain_before, plain_predicted, plain_after) = results["fused"], results["plain"]
    assert before["eval_loss"] == plain_before["eval_loss"] and before["eval_accuracy"] == plain_before["eval_accuracy"]
    assert predicted.predictions.shape == (6, 12, VOCAB)
    assert (predicted.predictions == plain_predicted.predictions).all()
    assert predicted.metrics["test_loss"] == plain_predicted.metrics["test_loss"]
    assert all(torch.equal(a, b) for a, b in zip(seen["fused"][:2], seen["plain"][:2], strict=True))
    assert abs(after["eval_loss"] - plain_after["eval_loss"]) <= LOSS_TOLERANCE * plain_after["eval_loss"]
    assert relative_l2(seen["plain"][2], seen["fused"][2]) <= UPDATE_TOLERANCE
    assert len(fused_losses) == 4  # the training's micro-batches used the chunked loss; evaluation did not


# -- 2. TRL SFTTrainer --------------------------------------------------------------------------------------
def _word_tokenizer() -> Any:
    """A WordLevel tokenizer over whitespace-split words ``w0``..``w123`` and four special tokens: no hub."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(VOCAB - 4)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                                bos_token="<bos>", unk_token="<unk>")


def test_trl_sft_trainer_trains_like_plain(checkpoints, tmp_path, fused_losses):
    """A tiny SFT run (texts of different lengths, padded; gradient accumulation): losses and weights equal plain's.

    TRL 1.16's SFTTrainer patches the model's forward with its own chunked head (``add_fused_lm_head``) and trains
    through it (``fused_lm_head=True`` runs the backbone and the head's weight itself): the root's forward, so this
    family, is not called in its training steps. The test checks what that means: the run is the plain model's,
    and the family's loss ran only where TRL calls the model's own forward with labels (none in this run).
    """
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    path = checkpoints("llama")
    generator = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 4, (int(n),), generator=generator))
             for n in torch.randint(4, 14, (12,), generator=generator)]
    dataset = datasets.Dataset.from_dict({"text": texts})
    initial = _state(_load(path))
    runs = {}
    for side, fusion in (("plain", None), ("fused", CHUNKED)):
        model = _load(path, fusion)

        class Recording(trl.SFTTrainer):
            def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
                loss = super().training_step(*args, **kwargs)
                self.micro_losses = [*getattr(self, "micro_losses", []), float(loss)]
                return loss

        config = trl.SFTConfig(
            output_dir=str(tmp_path / side), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
            learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
            use_cpu=True, save_strategy="no", seed=7, disable_tqdm=True, max_length=12, packing=False,
            dataset_text_field="text", bf16=False,  # SFTConfig defaults to bf16 (CPU autocast too): float32 here
        )
        trainer = Recording(model=model, args=config, train_dataset=dataset, processing_class=_word_tokenizer())
        trainer.train()
        runs[side] = (trainer, model)
    (fused, fused_model), (plain, plain_model) = runs["fused"], runs["plain"]
    assert isinstance(fused_model, LinearCrossEntropyMixin)
    _assert_same_losses(fused.micro_losses, plain.micro_losses)
    _assert_same_logged_losses(_logged_losses(fused), _logged_losses(plain))
    _assert_same_updates(_state(fused_model), _state(plain_model), initial)
    trl_head = hasattr(trl.trainer.utils, "add_fused_lm_head")
    assert (not fused_losses) if trl_head else len(fused_losses) == 6


# -- 3. PEFT LoRA through Trainer -----------------------------------------------------------------------------
@pytest.mark.parametrize("head", ["lora", "modules_to_save"])
def test_peft_lora_through_trainer(checkpoints, tmp_path, fused_losses, head):
    """LoRA from ``peft.get_peft_model`` on the fused and on the plain model, trained by Trainer: the same losses,
    the same adapter weights; the head adapted by LoRA, or trained whole as a ``modules_to_save`` copy."""
    peft = pytest.importorskip("peft")
    path = checkpoints("llama")
    targets = ["q_proj", "v_proj"] + (["lm_head"] if head == "lora" else [])
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
                             modules_to_save=["lm_head"] if head == "modules_to_save" else None)
    runs = {}
    for side, fusion in (("plain", None), ("fused", CHUNKED)):
        torch.manual_seed(3)
        model = peft.get_peft_model(_load(path, fusion), copy.deepcopy(config))
        initial = _state(model, trainable_only=True)
        trainer = RecordingTrainer(model=model, args=_arguments(tmp_path / side), train_dataset=_token_dataset(12))
        trainer.train()
        runs[side] = (trainer, _state(model, trainable_only=True), initial)
    (fused, fused_state, initial), (plain, plain_state, plain_initial) = runs["fused"], runs["plain"]
    assert all(torch.equal(initial[k], plain_initial[k]) for k in initial)
    assert any("lm_head" in name for name in fused_state) and len(fused_losses) == 6
    _assert_same_losses(fused.micro_losses, plain.micro_losses)
    _assert_same_updates(fused_state, plain_state, initial)


# -- 4. the other families on at once -----------------------------------------------------------------------
def _sgd_steps(model: nn.Module, steps: int = 3, lr: float = 0.05, **call: Any) -> list[float]:
    """``steps`` SGD steps on batches with masked labels; the losses."""
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    generator = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (2, 13), generator=generator)
        labels = ids.clone()
        labels[0, :4] = -100
        labels[1, -3] = -100
        loss = model(input_ids=ids, labels=labels, **call).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def test_with_qkv_and_gate_up(checkpoints, fused_losses):
    """``qkv + gate_up + linear_cross_entropy``: the losses and the updates (of q/k/v and gate/up as the checkpoint
    names them) equal plain's."""
    path = checkpoints("llama")
    plain = _load(path)
    fused = _load(path, {"qkv": True, "gate_up": True, **CHUNKED})
    assert set(fusion_core.get_fusion_plan(fused).families) == {"qkv", "gate_up", "linear_cross_entropy"}
    initial = _state(plain)
    _assert_same_losses(_sgd_steps(fused), _sgd_steps(plain))
    assert len(fused_losses) == 3
    _assert_same_updates(_state(fused), _state(plain), initial)  # state_dict: q/k/v, gate/up as in the checkpoint


def test_with_moe_experts_and_the_router_loss(checkpoints, fused_losses):
    """A Mixtral with the router's auxiliary loss (added to the chunked loss by the model's forward), ``qkv`` and
    ``moe_experts``, which stacks the experts on 4.57 (on 5.x it finds nothing to fuse and is left out,
    ``required: false``): the losses and the updates equal plain's."""
    path = checkpoints("mixtral")
    plain = _load(path)
    moe = {"required": False} if TF5 else True
    fused = _load(path, {"qkv": True, "moe_experts": moe, **CHUNKED})
    families = set(fusion_core.get_fusion_plan(fused).families)
    assert families == ({"qkv", "linear_cross_entropy"} | (set() if TF5 else {"moe_experts"}))
    initial = _state(plain)
    call = dict(output_router_logits=True)
    _assert_same_losses(_sgd_steps(fused, **call), _sgd_steps(plain, **call))
    assert len(fused_losses) == 3
    _assert_same_updates(_state(fused), _state(plain), initial)


@pytest.fixture
def packing_wins(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``linear_kernels`` packs every layer it may (its packing timer reports the packed kernel fastest, so no
    clock decides the test); its decisions are forgotten before and after."""
    linear_kernels = pytest.importorskip("fusion_linear_kernels")
    from fusion_linear_kernels import compat, packing

    from fusion_core.plugin import Decisions

    if not compat.available():
        pytest.skip("this torch build has no oneDNN prepacked linear")
    monkeypatch.setattr(Decisions, "times", fake_clock({"linear_kernels.packing": original_slowest}))
    packing.clear_pack_decisions()
    yield linear_kernels
    packing.clear_pack_decisions()


def test_with_linear_kernels_packing_frozen_weights_under_lora(checkpoints, fused_losses, packing_wins):
    """``qkv + gate_up + linear_kernels`` packs the frozen weights (the head too, untied); LoRA on q/v and the head
    trains through them: the chunked loss runs the packed head per chunk; losses and adapter updates equal plain's
    (LoRA on the model without linear_kernels and linear_cross_entropy)."""
    peft = pytest.importorskip("peft")
    path = checkpoints("llama")
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"],
                             init_lora_weights=False)
    models = {}
    for side, fusion in (("plain", {"qkv": True, "gate_up": True}),
                         ("fused", {"qkv": True, "gate_up": True, "linear_kernels": True, **CHUNKED})):
        torch.manual_seed(3)
        models[side] = peft.get_peft_model(_load(path, fusion), copy.deepcopy(config))
    fused, plain = models["fused"], models["plain"]
    base = fused.get_base_model()
    assert base.lm_head.base_layer.packed and base.model.layers[0].self_attn.o_proj.packed
    initial = _state(plain, trainable_only=True)
    _assert_same_losses(_sgd_steps(fused), _sgd_steps(plain))
    assert len(fused_losses) == 3
    _assert_same_updates(_state(fused, trainable_only=True), _state(plain, trainable_only=True), initial)


# -- 5. DDP and FSDP2 -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_ddp_and_fsdp2_train_like_plain(tmp_path):
    """Two gloo ranks (distributed_worker.py): DDP and FSDP2 (``fully_shard`` per layer, then the model) train the
    fused model like the plain one, untied and tied heads. With the head in an FSDP2 group of its own, the family
    falls back to the original forward with one warning (its hooks re-gather the weight per call, which the chunked
    loss cannot differentiate) and trains like plain."""
    world = 2
    worker = Path(__file__).with_name("distributed_worker.py")
    expected = {f"{name}{what}" for name in ("llama", "qwen2_tied") for what in (
        ": the model is fused", " DDP: losses", " DDP: weight updates", " DDP: no fallback warning",
        " FSDP2: the head's weight is sharded", " FSDP2: losses", " FSDP2: weight updates",
        " FSDP2: no fallback warning")}
    expected |= {f"llama FSDP2 (head in its own group){what}" for what in (
        ": losses", ": weight updates", ": one fallback warning", ": the original forward's logits")}
    run_job([sys.executable, str(worker), str(world), str(tmp_path)], world, tmp_path, expected, every_rank=True,
            env={**os.environ, "USE_HUB_KERNELS": "NO"}, timeout=600)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_a_head_holding_dtensors_runs_the_original_forward_once_warned(checkpoints):
    """In one process: a head whose parameters are DTensors (what FSDP2 leaves on a head sharded in a group of its
    own between calls, or tensor parallelism) is not run chunk by chunk: one warning, then the original forward,
    so the plain model's losses and trained head, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    path = checkpoints("llama")
    plain, fused = _load(path), _load(path, CHUNKED)
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for model in (plain, fused):  # only the head trains: DTensor has no rule for every op of a backward
            model.requires_grad_(False)
            head = model.get_output_embeddings()
            head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Replicate()]))
        assert isinstance(fused.lm_head.weight, DTensor)
        with pytest.warns(UserWarning, match="holds DTensor parameters.*original forward") as caught, \
                implicit_replication():  # the plain tensors the head's input and the labels meet are replicated
            losses = _sgd_steps(fused, steps=2), _sgd_steps(plain, steps=2)
        assert len([w for w in caught if "linear_cross_entropy" in str(w.message)]) == 1
        _assert_same_losses(*losses)
        full = [{k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in _state(m).items()}
                for m in (fused, plain)]
        assert full[0].keys() == full[1].keys() and all(torch.equal(full[0][k], full[1][k]) for k in full[1])
    finally:
        torch.distributed.destroy_process_group()

