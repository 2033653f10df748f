"""Hugging Face `transformers.Trainer` on CPU (2 processes, gloo), checkpointed by the Trainer.

A tiny `LlamaForCausalLM` (built from a `LlamaConfig`, no download) trains on a deterministic
token dataset; `save_steps=--save-at` makes the Trainer itself write `<out>/checkpoint-K`, and
`trainer.train(resume_from_checkpoint=DIR)` resumes from one. Modes:

* default: FSDP2 with `state_dict_type="SHARDED_STATE_DICT"` (`fsdp="full_shard"`,
  `fsdp_config={"version": 2, ...}`). The checkpoint holds two DCP roots,
  `pytorch_model_fsdp_0/` ({"model": ...}) and `optimizer_0/` ({"optimizer": ...}), beside
  `scheduler.pt`, `rng_state_N.pth`, `trainer_state.json` and `training_args.bin`. The Trainer
  builds its Accelerator on the PartialState that `TrainingArguments` set up, and accelerate turns
  FSDP on only for accelerator devices (on CPU it is MULTI_CPU and the plugin is silently
  ignored); as in accelerate_train.py, once `args.device` has set up gloo the state's distributed
  type is set to MULTI_GPU, so the Trainer's Accelerator takes its FSDP2 path (`fully_shard` on
  the CPU mesh). The script checks that every parameter is a DTensor.
* `--no-fsdp`: plain DDP; the checkpoint is `model.safetensors`, `optimizer.pt`, ...
* `--lora`: a PEFT LoRA adapter (r=4 on q_proj, v_proj) on the tiny Llama, under FSDP2 as in
  the default (the frozen base weights are sharded too: FSDP2's `fully_shard` takes frozen and
  trainable parameters in one group, no `use_orig_params`). The Trainer saves with
  `adapter_only=True`: `pytorch_model_fsdp_0/` holds the adapter's tensors alone (PEFT's
  names, `get_peft_model_state_dict`, without the adapter name) and `optimizer_0/` their
  optimizer state; resuming loads them into a model whose base weights are rebuilt from the seed.
  `--lora --no-fsdp`: the same adapter under plain DDP; the Trainer's checkpoint is an adapter
  folder (`adapter_model.safetensors`, ...). Either way `<out>/base` is the base model
  (`save_pretrained`, written before the adapter is added, and named in the adapter's
  `base_model_name_or_path`), `<out>/adapter` the adapter at --save-at (`save_pretrained`, by
  rank 0, of the adapter's tensors gathered from every rank under FSDP).

Losses: the Trainer's per-step training loss (what `compute_loss` returns), averaged over the
ranks exactly (float.hex). `--export-model`: rank 0's torch.save of the model's full state_dict
at --save-at (for `--lora`, the PeftModel's: base and adapter tensors).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import transformers
from accelerate import PartialState
from accelerate.utils import DistributedType
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from examples.frameworks.common import (
    SEED,
    VOCAB,
    arguments,
    deterministic,
    export_full,
    mean_loss,
    write_losses,
)

SEQ, PER_DEVICE = 8, 4
SAMPLES = 256  # more than any run here draws: the run stops at max_steps inside epoch 1


class Tokens(Dataset):
    """Sample `i`: a function of `i` alone (random start, then a fixed learnable rule)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(SEED * 1_000_003 + i * 1009)
        x = torch.empty(SEQ, dtype=torch.long)
        x[0] = torch.randint(0, VOCAB, (1,), generator=g)
        noise = torch.randint(0, VOCAB, (SEQ,), generator=g)
        for t in range(1, SEQ):
            # mostly x -> 7x + 3, now and then a random token
            x[t] = (x[t - 1] * 7 + 3) % VOCAB if noise[t] % 4 else noise[t]
        return {
            "input_ids": x,
            "labels": x.clone(),
            "attention_mask": torch.ones(SEQ, dtype=torch.long),
        }


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


class LossTrainer(Trainer):
    """Records each optimizer step's loss, averaged over the ranks (a collective: every rank
    runs compute_loss once per step, gradient accumulation being 1)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.step_losses: dict[str, str] = {}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = out[0] if return_outputs else out
        if model.training:
            self.step_losses[str(self.state.global_step + 1)] = mean_loss(loss)
        return out


class Hooks(TrainerCallback):
    """FSDP2: every parameter is a DTensor once the Trainer has prepared the model. At the
    --save-at checkpoint: the model's full state_dict (every rank gathers), its config.json
    in <out>/hf-config and, for LoRA, the plain adapter folder (under FSDP, save_pretrained of the
    full state_dict that every rank gathered: PEFT picks out the adapter's tensors)."""

    def __init__(self, trainer: LossTrainer, args: Any, fsdp: bool, lora: bool) -> None:
        self.trainer, self.args, self.fsdp, self.lora = trainer, args, fsdp, lora

    def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if self.fsdp:
            from torch.distributed.tensor import DTensor

            params = list(self.trainer.model.parameters())
            assert params and all(isinstance(p, DTensor) for p in params), "not sharded"

    def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step != self.args.save_at:
            return
        model = self.trainer.model
        export_full(model, self.args.export_model)
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        full = None
        if self.lora and self.fsdp:  # collective: every rank gathers, rank 0 keeps it
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            full = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if self.trainer.accelerator.is_main_process:
            if self.lora:
                # state_dict=None (DDP): the module's own tensors are already whole
                unwrapped.save_pretrained(self.args.out / "adapter", state_dict=full)
            else:  # a sharded save holds no config.json: what a release takes as --extra
                unwrapped.config.save_pretrained(self.args.out / "hf-config")
        self.trainer.accelerator.wait_for_everyone()


def main() -> None:
    flags = {f: f in sys.argv for f in ("--no-fsdp", "--lora")}
    for f, on in flags.items():
        if on:
            sys.argv.remove(f)
    lora = flags["--lora"]
    fsdp = not flags["--no-fsdp"]
    args = arguments()
    deterministic()
    started = time.time()

    extra: dict[str, Any] = {}
    if fsdp:
        extra = {
            # fsdp="full_shard" (a string) is deprecated in 5.x: reshard_after_forward says it
            "fsdp": True,
            "fsdp_config": {
                "version": 2,
                "state_dict_type": "SHARDED_STATE_DICT",
                "reshard_after_forward": True,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            },
        }
    targs = TrainingArguments(
        output_dir=str(args.out),
        max_steps=args.steps,
        save_strategy="steps" if args.save_at > 0 else "no",
        save_steps=max(args.save_at, 1),
        per_device_train_batch_size=PER_DEVICE,
        learning_rate=1e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=2,
        use_cpu=True,
        seed=SEED,
        data_seed=SEED,
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        **extra,
    )
    assert targs.device.type == "cpu"  # sets up PartialState (gloo on the CPU)
    if fsdp:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU

    model: torch.nn.Module = tiny_llama()
    if lora:
        import peft

        base_dir = args.out / "base"
        if PartialState().is_main_process:
            model.save_pretrained(base_dir)
        model.config._name_or_path = str(base_dir)
        model.name_or_path = str(base_dir)
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )

    trainer = LossTrainer(model=model, args=targs, train_dataset=Tokens())
    if fsdp:
        assert trainer.is_fsdp_enabled, trainer.accelerator.distributed_type
    trainer.add_callback(Hooks(trainer, args, fsdp, lora))

    resume = str(args.resume) if args.resume is not None else None
    trainer.train(resume_from_checkpoint=resume)
    if trainer.accelerator.is_main_process:
        versions = {"transformers": transformers.__version__, "torch": torch.__version__}
        if lora:
            import peft

            versions["peft"] = peft.__version__
        mode = ("fsdp2-lora" if lora else "fsdp2") if fsdp else ("lora" if lora else "ddp")
        seconds = round(time.time() - started, 1)
        write_losses(args.losses, trainer.step_losses, mode=mode, seconds=seconds, **versions)
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
