"""Megatron-core on CPU (gloo, TP=1, PP=1, DP=2), checkpointed by `dist_checkpointing.save`.

`--tp 2` (an extra option) runs TP=2, DP=1 instead: the checkpoint's tensors then come in
tensor-parallel chunks (e.g. linear_qkv.weight [2, 64, 32] as four [1, 32, 32] chunks).

`--llama` (an extra option) builds the model Llama-style instead: RMSNorm (torch.nn.RMSNorm,
eps 1e-5), SwiGLU MLP (ffn_hidden_size 64: linear_fc1 [128, 32] holds the gate's rows, which
go through silu, then the up projection's), rotary position embeddings (rotate-half, not
interleaved; base 10000, rotary_percent 1.0; no learned position embeddings), no biases and an
output layer of its own (untied embeddings). Save layout, --resume, --tp and --load-release
work the same; a checkpoint resumes only into a run with the same choice.

`--export-logits FILE` (an extra option): at --save-at, after that step's update, the model's
logits in eval mode under torch.no_grad() on a fixed input, tokens = arange(2 * SEQ) % VOCAB
as [2, SEQ] (0..3 and 4..7), with the causal mask and positions 0..SEQ-1 of training; rank 0
torch.saves {"tokens": [2, SEQ] int64, "logits": [2, SEQ, VOCAB] float32} (GPTModel returns
[b, s, v] without labels; under TP the vocab-parallel logits are gathered first).

A tiny GPTModel (local transformer layer spec: no Transformer Engine, no apex; 2 layers,
hidden 32, 4 heads in 2 query groups, vocab 64, sequence 4) wrapped in Megatron's own
DistributedDataParallel and trained with Megatron's own optimizer (`get_megatron_optimizer`:
fp32 params, no distributed optimizer, so a ChainedOptimizer of one `FP32Optimizer` around
`torch.optim.AdamW`; its state goes into the checkpoint as `optimizer.state.exp_avg.<param key>`
sharded tensors laid out like the parameters) and `OptimizerParamScheduler`.
Megatron's DistributedOptimizer cannot run here: it refuses parameters whose type() is not
torch.cuda.*Tensor (distrib_optimizer.py, "Wrapped parameters must be one of ..."). Gradient
clipping is off (--clip-grad 0, a Megatron-LM setting) for the same reason: clip_grads.py asserts
`param.grad.type() == 'torch.cuda.FloatTensor'`.

The step-K checkpoint is laid out the way Megatron-LM's `save_checkpoint`
(megatron/training/checkpointing.py, core_v0.16.1) lays a `torch_dist` checkpoint out:

    <out>/latest_checkpointed_iteration.txt      "3"
    <out>/iter_0000003/                          dist_checkpointing.save(...) of
        {args, checkpoint_version, iteration, model, optimizer, opt_param_scheduler,
         rng_state, num_floating_point_operations_so_far}

with the same save strategy Megatron-LM uses by default (torch_dist wrapped in
FullyParallelSaveStrategyWrapper over the data-parallel group) and the same content metadata.
`--load-release DIR --steps K` loads a release (its safetensors, through the model's own
`load_state_dict`) and computes step K's loss with it, before any update: a release of the
step K-1 checkpoint gives the uninterrupted run's step-K loss exactly.

`--resume DIR` (the iter_ directory, or the directory holding the tracker file) builds the
same sharded state dict with `is_loading=True`, `dist_checkpointing.load`s it and restores model,
optimizer, scheduler, RNG and iteration as Megatron-LM's `load_checkpoint` does.

The checkpoint's keys are not the model's state_dict() names: the layers are stacked along a new
leading axis (`decoder.layers.mlp.linear_fc1.weight`, shape [2, 128, 32], for
`decoder.layers.{0,1}.mlp.linear_fc1.weight`) and the local spec stores its layernorms under
Transformer Engine's names (`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`,
`pre_mlp_layernorm.` -> `mlp.linear_fc1.layer_norm_`). `--export-model` writes the model's own
`state_dict()` (rank 0; with TP=1 every tensor is already whole).

CPU patches (`_run_megatron_core_on_cpu`, all in this file): Megatron-core places tensors with
`torch.cuda.current_device()` and a few literal `device="cuda"`, and keeps a "CUDA" RNG state
(and its tracker) that it reads and writes through torch.cuda. On a CPU-only torch those raise;
here the device is the CPU and the CUDA default generator is stood in for by a CPU generator
whose state round-trips through the checkpoint like the real one would.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from examples.frameworks.common import (
    BATCH,
    SEED,
    SEQ,
    VOCAB,
    arguments,
    batch,
    deterministic,
    mean_loss,
    write_losses,
)

HIDDEN, LAYERS, HEADS, GROUPS = 32, 2, 4, 2
LLAMA_FFN, ROPE_BASE, NORM_EPS = 64, 10000, 1e-5  # --llama
TRACKER = "latest_checkpointed_iteration.txt"


# --------------------------------------------------------------------------- CPU patches
class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Tensor factories called with a literal `device="cuda"` make CPU tensors instead. In this
    run: FP32Optimizer's loss scale (optimizer.py), the grad-norm buffers of
    get_grad_norm_fp32 (clip_grads.py) and local_multi_tensor_l2_norm (utils.py), which the
    optimizer step computes even with clip_grad 0."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _run_megatron_core_on_cpu() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # 1. Megatron allocates with device=torch.cuda.current_device(): in this run the DDP grad
    #    buffer (param_and_grad_buffer.py), the attention matmul buffer (utils.py,
    #    GlobalMemoryBuffer.get_tensor) and the save's finalize flag (state_dict_saver.py).
    torch.cuda.current_device = lambda: torch.device("cpu")
    # ... and synchronizes before writing the shards (filesystem_async.py preload_tensors):
    # nothing to wait for on the CPU.
    torch.cuda.synchronize = lambda device=None: None
    # 2. The "CUDA" default generator (model_parallel_cuda_manual_seed, the RNG tracker's
    #    fork/add, get_rng_state in the checkpoint) is a CPU generator here.
    cuda_gen = torch.Generator()
    torch.cuda.manual_seed = lambda seed: cuda_gen.manual_seed(int(seed))
    torch.cuda.get_rng_state = lambda device="cuda": cuda_gen.get_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": cuda_gen.set_state(state)
    mrandom._get_cuda_rng_state = lambda *a, **k: cuda_gen.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: cuda_gen.set_state(state)
    # 3. Literal device="cuda" tensor factories.
    _CudaToCpu().__enter__()


# --------------------------------------------------------------------------- setup
def megatron_args(
    cli: argparse.Namespace, world: int, tp: int, llama: bool = False
) -> argparse.Namespace:
    """What Megatron-LM keeps in state_dict['args']: the run's argparse.Namespace, with the
    value types Megatron-LM's parsed arguments have (str paths, torch dtypes, enums)."""
    from megatron.core.transformer.enums import AttnBackend

    dp = world // tp  # PP = CP = 1
    args = argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
        num_attention_heads=HEADS, group_query_attention=True, num_query_groups=GROUPS,
        kv_channels=HIDDEN // HEADS, seq_length=SEQ, max_position_embeddings=SEQ,
        padded_vocab_size=VOCAB, position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False, transformer_impl="local",
        normalization="LayerNorm", hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        context_parallel_size=1, expert_model_parallel_size=1, world_size=world,
        data_parallel_size=dp, micro_batch_size=BATCH, global_batch_size=BATCH * dp,
        optimizer="adam", lr=1e-2, min_lr=1e-3, lr_decay_style="cosine", lr_warmup_iters=1,
        lr_decay_iters=cli.steps, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=1e-8, clip_grad=0.0, fp16=False, bf16=False, params_dtype=torch.float32,
        main_grads_dtype=torch.float32, main_params_dtype=torch.float32,
        exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
        attention_backend=AttnBackend.local, spec=["local"],
        use_distributed_optimizer=False, seed=SEED, data_parallel_random_init=False,
        train_iters=cli.steps, save_interval=cli.save_at, save=str(cli.out),
        load=None if cli.resume is None else str(cli.resume), ckpt_format="torch_dist",
        ckpt_fully_parallel_save=True, ckpt_fully_parallel_load=False,
        ckpt_assume_constant_structure=False, dist_ckpt_strictness="assume_ok_unexpected",
        async_save=False, no_save_optim=False, no_save_rng=False, no_load_optim=False,
        no_load_rng=False, finetune=False, consumed_train_samples=0,
        skipped_train_samples=0, consumed_valid_samples=0,
    )  # fmt: skip
    if llama:  # Megatron-LM's --normalization RMSNorm --swiglu --position-embedding-type rope ...
        vars(args).update(
            ffn_hidden_size=LLAMA_FFN, normalization="RMSNorm", norm_epsilon=NORM_EPS,
            swiglu=True, position_embedding_type="rope", use_rotary_position_embeddings=True,
            rotary_base=ROPE_BASE, rotary_percent=1.0, rotary_interleaved=False,
            apply_rope_fusion=False, bias_swiglu_fusion=False, add_bias_linear=False,
            add_qkv_bias=False, untie_embeddings_and_output_weights=True,
        )  # fmt: skip
    return args


def build(args: argparse.Namespace, llama: bool = False):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    # Megatron-LM's _set_random_seed (data_parallel_random_init off: the same seed everywhere).
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)

    llama_config = {}
    if llama:
        llama_config = dict(
            normalization="RMSNorm", layernorm_epsilon=NORM_EPS, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
            rotary_interleaved=False, apply_rope_fusion=False, bias_activation_fusion=False,
        )  # fmt: skip
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, sequence_parallel=False,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=1, **llama_config,
    )  # fmt: skip
    if llama:
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(
                num_experts=None, moe_grouped_gemm=False, normalization="RMSNorm"
            ),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=ROPE_BASE,
            share_embeddings_and_output_weights=False,
            pre_process=True,
            post_process=True,
        )
    else:
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(
                num_experts=None, moe_grouped_gemm=False
            ),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=True,
            pre_process=True,
            post_process=True,
        )
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module=gpt,
    )
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, fp16=False, bf16=False, params_dtype=torch.float32,
        use_distributed_optimizer=False,
    )  # fmt: skip
    optimizer = get_megatron_optimizer(optimizer_config, [ddp])
    # Megatron-LM counts the schedule in samples (iterations x global batch size).
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    assert parallel_state.get_data_parallel_world_size() == args.data_parallel_size
    return gpt, ddp, optimizer, scheduler


# --------------------------------------------------------------------------- checkpointing
def get_rng_state(args: argparse.Namespace):
    """Megatron-LM's get_rng_state for ckpt_format torch_dist (no expert parallelism)."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rng_state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    assert not args.data_parallel_random_init
    return ShardedObject(
        "rng_state",
        [rng_state],
        (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()),
        (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
        replica_id=mpu.get_data_parallel_rank(with_context_parallel=True),
    )


def sharded_sd_metadata(args: argparse.Namespace) -> dict:
    """Megatron-LM's _build_sharded_state_dict_metadata (no distributed optimizer)."""
    from megatron.core import parallel_state as mpu

    return {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True),
    }


def generate_state_dict(args, gpt, optimizer, scheduler, rng_state, iteration, *, loading):
    """Megatron-LM's generate_state_dict for ckpt_format torch_dist (one model chunk)."""
    metadata = sharded_sd_metadata(args)
    state_dict = {"args": args, "checkpoint_version": 3.0, "iteration": iteration}
    state_dict["model"] = gpt.sharded_state_dict(metadata=metadata)
    state_dict["optimizer"] = optimizer.sharded_state_dict(
        state_dict, is_loading=loading, metadata=metadata
    )
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    state_dict["rng_state"] = rng_state
    state_dict["num_floating_point_operations_so_far"] = 0
    return state_dict


def save_checkpoint(args, iteration, gpt, optimizer, scheduler) -> float:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    start = time.perf_counter()
    rank = torch.distributed.get_rank()
    checkpoint_name = os.path.join(args.save, f"iter_{iteration:07d}")
    rng_state = get_rng_state(args)
    # None unless a rerun is pending (then it would go in as 'rerun_state_machine').
    assert get_rerun_state_machine().state_dict(None, "torch_dist") is None
    state_dict = generate_state_dict(
        args, gpt, optimizer, scheduler, rng_state, iteration, loading=False
    )
    if rank == 0:
        os.makedirs(checkpoint_name, exist_ok=True)
    torch.distributed.barrier()
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"),
        mpu.get_data_parallel_group(with_context_parallel=True),
        args.ckpt_assume_constant_structure,
    )
    dist_checkpointing.save(
        state_dict,
        checkpoint_name,
        strategy,
        async_sharded_save=False,
        validate_access_integrity=True,
        content_metadata=_clean_metadata_for_serialization(sharded_sd_metadata(args)),
    )
    torch.distributed.barrier()
    if rank == 0:
        Path(args.save, TRACKER).write_text(str(iteration))
    return time.perf_counter() - start


def checkpoint_dir(path: Path) -> Path:
    """The iter_ directory itself, or the directory whose tracker file names it."""
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        return path / ("release" if text == "release" else f"iter_{int(text):07d}")
    return path


def load_checkpoint(args, gpt, optimizer, scheduler) -> int:
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    name = str(checkpoint_dir(Path(args.load)))
    common = dist_checkpointing.load_common_state_dict(name)
    ckpt_args = common["args"]
    assert (ckpt_args.tensor_model_parallel_size, ckpt_args.pipeline_model_parallel_size) == (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
    )
    shape = ("normalization", "position_embedding_type", "ffn_hidden_size")
    assert [getattr(ckpt_args, k) for k in shape] == [getattr(args, k) for k in shape], (
        "the checkpoint's model is not this run's (resume a --llama checkpoint with --llama)"
    )
    sharded = generate_state_dict(
        args, gpt, optimizer, scheduler, get_rng_state(args), 1, loading=True
    )
    state_dict = dist_checkpointing.load(
        sharded, name, get_default_load_sharded_strategy(name), strict=args.dist_ckpt_strictness
    )
    gpt.load_state_dict(state_dict["model"], strict=True)
    optimizer.load_state_dict(state_dict["optimizer"])
    scheduler.load_state_dict(state_dict["opt_param_scheduler"])
    args.consumed_train_samples = getattr(state_dict["args"], "consumed_train_samples", 0)
    rng = state_dict["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    np.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    torch.cuda.set_rng_state(rng["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["rng_tracker_states"])
    torch.distributed.barrier()
    return int(state_dict["iteration"])


# --------------------------------------------------------------------------- training
def causal_mask_and_positions(batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-LM's get_ltor_masks_and_position_ids: True where attention is masked out."""
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    positions = torch.arange(SEQ).unsqueeze(0).expand(batch_size, SEQ)
    return mask, positions


def train_step(ddp, optimizer, scheduler, args, step: int, dp_rank: int) -> torch.Tensor:
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    x, y = batch(step, dp_rank)
    mask, positions = causal_mask_and_positions()
    per_token = ddp(x, positions, mask, labels=y)  # [b, s] cross entropy
    loss = per_token.float().mean()
    loss.backward()
    finalize_model_grads([ddp])  # DP all-reduce of the grad buffers (mean)
    ok, _grad_norm, _ = optimizer.step()
    assert ok
    scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples += args.global_batch_size
    return loss


def export_model(gpt, path: Path | None) -> None:
    """Rank 0 writes the model's own state_dict(), tensors only (the `_extra_state` entries of
    the local linears are None). Under TP>1 each tensor-parallel parameter is gathered along its
    partition_dim first, which gives the TP=1 layout (GQA's fused qkv rows are grouped per query
    group, and TP splits whole groups; a gated linear_fc1 holds [gate; up] of its own rows on
    each rank, so the gates are gathered, then the ups). Every rank must call it (gathering is
    collective)."""
    from megatron.core import parallel_state as mpu

    if path is None:
        return
    tp = mpu.get_tensor_model_parallel_world_size()
    params = dict(gpt.named_parameters())
    full = {}
    for name, value in gpt.state_dict().items():
        if not torch.is_tensor(value):
            continue
        param = params.get(name)
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(value) for _ in range(tp)]
            torch.distributed.all_gather(
                parts, value.contiguous(), group=mpu.get_tensor_model_parallel_group()
            )
            if gpt.config.gated_linear_unit and name.endswith("mlp.linear_fc1.weight"):
                halves = [p.chunk(2, dim=param.partition_dim) for p in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            value = torch.cat(parts, dim=param.partition_dim)
        full[name] = value.detach().clone().contiguous()
    if torch.distributed.get_rank() == 0:
        torch.save(full, path)


def logits_input() -> torch.Tensor:
    """--export-logits' fixed input: arange(2 * SEQ) % VOCAB as [2, SEQ]."""
    return (torch.arange(2 * SEQ) % VOCAB).reshape(2, SEQ)


def export_logits(gpt, path: Path | None) -> None:
    """Rank 0 writes {"tokens", "logits"}: the model's float32 logits [b, s, v] in eval mode
    on logits_input(), with training's causal mask and positions. Every rank must call it (the
    forward is collective under TP: row-parallel all-reduces, then the vocab-parallel logits
    are gathered)."""
    from megatron.core import tensor_parallel

    if path is None:
        return
    tokens = logits_input()
    mask, positions = causal_mask_and_positions(tokens.shape[0])
    was_training = gpt.training
    gpt.eval()
    with torch.no_grad():
        logits = gpt(tokens, positions, mask)  # no labels: [b, s, v / tp]
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    gpt.train(was_training)
    assert logits.shape == (*tokens.shape, VOCAB), logits.shape
    if torch.distributed.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits.float().contiguous()}, path)


def load_release(gpt, directory: Path) -> None:
    """Megatron's own load of a release: its safetensors into the model's load_state_dict
    (the `_extra_state` entries, None in the local spec, are all a release may leave out)."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(f))
    missing, unexpected = gpt.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("._extra_state") for k in missing), missing


def main() -> None:
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    released = None
    if "--load-release" in sys.argv:  # evaluate the loss of step --steps with a release's weights
        at = sys.argv.index("--load-release")
        released = Path(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    tp = 1
    if "--tp" in sys.argv:  # tensor parallel size (default 1: TP=1, DP=world size)
        at = sys.argv.index("--tp")
        tp = int(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    llama = "--llama" in sys.argv  # the Llama-style model (RMSNorm, SwiGLU, RoPE, untied)
    if llama:
        sys.argv.remove("--llama")
    logits_path = None
    if "--export-logits" in sys.argv:  # the model's logits on a fixed input at --save-at
        at = sys.argv.index("--export-logits")
        logits_path = Path(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    cli = arguments()
    deterministic()
    torch.distributed.init_process_group("gloo")
    _run_megatron_core_on_cpu()
    import megatron.core
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    args = megatron_args(cli, torch.distributed.get_world_size(), tp, llama)
    gpt, ddp, optimizer, scheduler = build(args, llama)
    dp_rank = mpu.get_data_parallel_rank()

    iteration = 0
    losses, timings = {}, {}
    if released is not None:  # the loss of step --steps, before any update, from the release
        load_release(gpt, released)
        x, y = batch(cli.steps, dp_rank)
        mask, positions = causal_mask_and_positions()
        with torch.no_grad():
            losses[str(cli.steps)] = mean_loss(ddp(x, positions, mask, labels=y).float().mean())
        iteration = cli.steps
    if cli.resume is not None:
        start = time.perf_counter()
        iteration = load_checkpoint(args, gpt, optimizer, scheduler)
        timings["load_s"] = round(time.perf_counter() - start, 3)
    while iteration < cli.steps:
        loss = train_step(ddp, optimizer, scheduler, args, iteration + 1, dp_rank)
        iteration += 1
        losses[str(iteration)] = mean_loss(loss)
        if iteration == cli.save_at:
            saved = save_checkpoint(args, iteration, gpt, optimizer, scheduler)
            timings["save_s"] = round(saved, 3)
            export_model(gpt, cli.export_model)
            export_logits(gpt, logits_path)
            torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        write_losses(cli.losses, losses, megatron_core=megatron.core.__version__, **timings)
    torch.distributed.barrier()
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
