"""Real config files from ROLL, MindSpeed-MM, Accelerate, TRL and Trainer users (tests/fixtures/real_configs, with
MANIFEST.yaml naming each one's repository, path and commit), read as a user would give them: the model swapped for
a built-in one, the data for the built-in corpus and the devices for 2-4 ranks through --set, and checked field by
field against what the source tool does with the file (read from its own code: ROLL's fsdp2 strategy, MindSpeed-MM's
Fsdp2Config, Accelerate's FSDP plugin, TrainingArguments' fsdp_config) - or refused with one line naming the file and
the key as written.

The plans are built in this process, as `fsdp2kit check --json` builds them on each rank, under torch's fake process
group of the file's world size; one subprocess runs the real command line on a file of each dialect."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, process_group, run_cli

from fsdp2kit.check import describe
from fsdp2kit.config.dialects import mindspeed_native
from fsdp2kit.config.load import load_config, name_as_written
from fsdp2kit.errors import UserError
from fsdp2kit.models.vl import BUILTIN_VL_MODELS

CORPUS = REPO / "tests/fixtures/real_configs"
MANIFEST = yaml.safe_load((CORPUS / "MANIFEST.yaml").read_text())
JOB = "examples/demo.yaml"  # the job a strategy file (MindSpeed-MM, Accelerate, Trainer) is given beside
LAYERS = [f"model.layers.{i}" for i in range(4)]
CPU_ONLY = not torch.cuda.is_available()
REAL_CONTEXT = 40960  # Qwen3's max_position_embeddings: ROLL's files train on up to 2048 + 4096 tokens

# What the source tool's plan is for each kind of file, field by field (see the module docstring).
ROLL_DENSE = {  # fsdp_size >= world: one FSDP dim; _no_split_modules; ROLL's bf16/fp32, uncast inputs, recompute
    "mesh": [2],
    "sharded_modules": ["", *LAYERS],
    "reshard_after_forward": True,
    "mixed_precision": ["bfloat16", "float32", None, False],
    "offload": [False, False],
    "recompute_modules": LAYERS,
    "activation_offload_modules": [],
    "prefetch": [0, 1],
    "frozen_modules": [],
}
ROLL_MOE = {  # wrap_embeddings/wrap_lm_output, attention and MoE blocks as layer classes, bf16 reduce (30B-A3B files)
    **ROLL_DENSE,
    "sharded_modules": [
        "",
        "model.embed_tokens",
        *[f"model.layers.{i}.{part}" for i in range(4) for part in ("self_attn", "mlp")],
        "lm_head",
    ],
    "mixed_precision": ["bfloat16", "bfloat16", None, False],
}
# With ep_size > 1 ROLL wraps wrap_policy.moe_experts too (the fused experts, each layer's on the expert mesh).
ROLL_MOE_EP = {
    **ROLL_MOE,
    "sharded_modules": [
        "",
        "model.embed_tokens",
        *[f"model.layers.{i}.{part}" for i in range(4) for part in ("self_attn", "mlp", "mlp.experts")],
        "lm_head",
    ],
}
# Qwen3.5-35B-A3B's ROLL files: its linear-attention (layer 0) and attention (layer 1) blocks and MoE blocks by class,
# the vision tower left in the root (no class of it is named), no recompute (disable_gradient_checkpointing: true).
QWEN35_TEXT = "model.language_model"
ROLL_QWEN35_MOE = {
    **ROLL_MOE,
    "sharded_modules": [
        "",
        f"{QWEN35_TEXT}.embed_tokens",
        f"{QWEN35_TEXT}.layers.0.linear_attn",
        f"{QWEN35_TEXT}.layers.0.mlp",
        f"{QWEN35_TEXT}.layers.1.self_attn",
        f"{QWEN35_TEXT}.layers.1.mlp",
        "lm_head",
    ],
    "recompute_modules": [],
}
ROLL_QWEN35_MOE_EP = {
    **ROLL_QWEN35_MOE,
    "sharded_modules": [
        *ROLL_QWEN35_MOE["sharded_modules"][:4],
        f"{QWEN35_TEXT}.layers.0.mlp.experts",
        *ROLL_QWEN35_MOE["sharded_modules"][4:6],
        f"{QWEN35_TEXT}.layers.1.mlp.experts",
        "lm_head",
    ],
}
ACCELERATE_LAYERS = {  # TRANSFORMER_BASED_WRAP of _no_split_modules, FULL_SHARD
    "mesh": [2],
    "sharded_modules": ["", *LAYERS],
    "reshard_after_forward": True,
    "mixed_precision": ["bfloat16", "bfloat16", "bfloat16", True],  # Accelerate's set_mixed_precision policy
    "offload": [False, False],
    "recompute_modules": [],
    "activation_offload_modules": [],
    "prefetch": [0, 1],
    "frozen_modules": [],
}
FULL_PRECISION = {**ACCELERATE_LAYERS, "mixed_precision": ["float32", "float32", None, True]}
ACCELERATE_CP = {**ACCELERATE_LAYERS, "recompute_modules": LAYERS}  # the CP files: fsdp_activation_checkpointing
ROOT_ONLY = {**FULL_PRECISION, "sharded_modules": [""]}  # Accelerate without fsdp_config: NO_WRAP
# Qwen2.5-VL / Qwen3-VL: _no_split_modules (vision blocks, decoder layers) and fsdp2kit's projector group (issue 15's
# VL plan; ROLL and MindSpeed-MM leave the merger in the root group); untied embeddings (ROLL); vision groups uncast.
VL_TOWER = ["model.visual.blocks.0", "model.visual.blocks.1", "model.visual.merger"]
VL_LAYERS = ["model.language_model.layers.0", "model.language_model.layers.1"]
ROLL_VL = {
    **ROLL_DENSE,
    "sharded_modules": ["", *VL_TOWER, "model.language_model.embed_tokens", *VL_LAYERS],
    "recompute_modules": [*VL_TOWER[:2], *VL_LAYERS],
}
MINDSPEED_VL = {
    "mesh": [4],
    "sharded_modules": ["", *VL_TOWER, "model.visual.deepstack_merger_list.0", *VL_LAYERS],
    "reshard_after_forward": True,
    "mixed_precision": ["bfloat16", "float32", None, True],
    "offload": [False, False],
    "recompute_modules": [],
    "activation_offload_modules": [],
    "prefetch": [1, 1],
    "frozen_modules": [],
}
# MindSpeed-MM's native trainer files (mindspeed_mm/fsdp): exactly the modules of fsdp_plan.apply_modules and the root
# (its `mtp` head exists only with mtp_num_layers > 0), features.recompute_plan non-reentrant, bf16 compute with fp32
# reduction and cast inputs, its prefetch counts (0 where the file is silent), model.freeze.
TOWER = ["model.visual", "model.visual.blocks.0", "model.visual.blocks.1"]
TEXT = ["model.language_model", "model.language_model.embed_tokens"]
TEXT_LAYERS = ["model.language_model.layers.0", "model.language_model.layers.1"]
NATIVE_QWEN35 = {
    "mesh": [2],
    "sharded_modules": ["", *TOWER, *TEXT, *TEXT_LAYERS, "lm_head"],
    "reshard_after_forward": True,
    "mixed_precision": ["bfloat16", "float32", None, True],
    "offload": [False, False],
    "recompute_modules": [*TOWER[1:], *TEXT_LAYERS],
    "activation_offload_modules": [*TOWER[1:], *TEXT_LAYERS],  # features.activation_offload_plan
    "prefetch": [1, 1],
    "frozen_modules": [],
}
NATIVE_QWEN35_MOE = {  # its linear-attention blocks (layer 0 only) and fused experts are groups of their own
    **NATIVE_QWEN35,
    "sharded_modules": [
        "",
        *TOWER,
        *TEXT,
        TEXT_LAYERS[0],
        f"{TEXT_LAYERS[0]}.linear_attn",
        f"{TEXT_LAYERS[0]}.mlp.experts",
        TEXT_LAYERS[1],
        f"{TEXT_LAYERS[1]}.mlp.experts",
        "lm_head",
    ],
}
NATIVE_QWEN3VL = {
    **NATIVE_QWEN35,
    "sharded_modules": [
        "",
        *TOWER,
        "model.visual.merger",
        "model.visual.deepstack_merger_list.0",
        *TEXT,
        *TEXT_LAYERS,
        "lm_head",
    ],
    "activation_offload_modules": [],
    "prefetch": [0, 0],
    "frozen_modules": ["model.visual"],
}
# Split by expert parallelism, each layer's experts are a group of their own on the expert mesh (MindSpeed-MM's
# expert_fully_shard_modules), whether fsdp_plan.apply_modules names them or not.
NATIVE_QWEN3VL_EP = {
    **NATIVE_QWEN3VL,
    "sharded_modules": [
        *NATIVE_QWEN3VL["sharded_modules"][:-3],
        *[group for layer in TEXT_LAYERS for group in (layer, f"{layer}.mlp.experts")],
        "lm_head",
    ],
}
# Kimi-K2.5 (its MoE language model's experts each a group, the LM head named language_model.lm_head) and Step3-VL
# (a frozen vision model, no prefetch given, no activation offload): module paths of their own code
# (tests/fixtures/remote_code).
KIMI_TEXT = [f"language_model.model.layers.{i}" for i in range(2)]
KIMI_TOWER = ["vision_tower.encoder.blocks.0", "vision_tower.encoder.blocks.1"]
NATIVE_KIMI_K25 = {
    **NATIVE_QWEN35,
    "sharded_modules": [
        "",
        "vision_tower",
        *KIMI_TOWER,
        "mm_projector",
        "language_model.model",
        "language_model.model.embed_tokens",
        *[group for layer in KIMI_TEXT for group in (layer, f"{layer}.mlp.experts")],
        "language_model.lm_head",
    ],
    "recompute_modules": [*KIMI_TOWER, *KIMI_TEXT],
    "activation_offload_modules": [*KIMI_TOWER, *KIMI_TEXT],
}
STEP3_TOWER = "model.vision_model"
STEP3_TEXT = [f"model.language_model.layers.{i}" for i in range(2)]
NATIVE_STEP3_VL = {
    **NATIVE_QWEN35,
    "sharded_modules": [
        "",
        STEP3_TOWER,
        *[f"{STEP3_TOWER}.transformer.resblocks.{i}" for i in range(2)],
        f"{STEP3_TOWER}.vit_downsampler1",
        f"{STEP3_TOWER}.vit_downsampler2",
        "model.vit_large_projector",
        "model.language_model",
        "model.language_model.embed_tokens",
        *STEP3_TEXT,
        "lm_head",
    ],
    "recompute_modules": STEP3_TEXT,
    "activation_offload_modules": [],
    "prefetch": [0, 0],
    "frozen_modules": [STEP3_TOWER],
}
# What a user of these files on this CPU machine changes with --set (keys of the file), each refused as written.
NATIVE_CPU_SWAPS: dict[str, list[str]] = {
    **{f"mindspeed_mm/examples/qwen3_6/qwen3_6_{size}_config.yaml": ["training.load=null"] for size in ("27B", "35B")},
    "mindspeed_mm/examples/qwen3vl/qwen3vl_30B_config_v1_A5.yaml": ["training.quantization_plan.recipe_name=null"],
}
# Expert parallelism as the files write it (8 or 16 ranks per expert group, of 8 to 32) scaled to the 2-4 ranks and
# the 4 experts of the stand-ins here, through the files' own keys: ep 2, and where the file shards each expert
# further (efsdp_size 4 of 32 ranks) efsdp 2, at 4 ranks. As written, the sizes do not divide the world (refused).
ROLL_STRATEGY = "{}.strategy_args.strategy_config"
EP_SCALED: dict[str, list[str]] = {
    "roll/examples/qwen3-30BA3B-rlvr_fsdp2/rlvr_config_ep.yaml": [
        f"{ROLL_STRATEGY.format('actor_train')}.ep_size=2",
        f"{ROLL_STRATEGY.format('actor_train')}.efsdp_size=2",
    ],
    **{
        f"roll/examples/{name}": [f"{ROLL_STRATEGY.format('sft_train')}.ep_size=2"]
        for name in ("qwen3-30BA3B-sft_fsdp2/sft_config_ep.yaml", "qwen3.5-35BA3-sft_fsdp2/sft_config_ep.yaml")
    },
    **{
        f"mindspeed_mm/{name}": ["parallel.expert_parallel_size=2"]
        for name in (
            "examples/qwen3_5/qwen3_5_122B_config.yaml",
            "examples/qwen3_5/qwen3_5_397B_config.yaml",
            "examples/kimik2_5/kimik2_5_config.yaml",
            "tests/st/run_configs/finetune_qwen3_5_35B/qwen3_5_35B_config.yaml",
            "tests/st/run_configs/finetune_qwen3vl_30B/qwen3vl_30B_config_v1.yaml",
        )
    },
}
OFFLOAD_CPU = (
    "'actor_train.strategy_args.strategy_config.offload_policy': CPU offload needs an accelerator (CUDA) and this "
    "machine has none; set offload_policy: false"
)
HYDRA = (
    "'defaults' is a Hydra defaults list (../config/traj_envs@_here_), which Hydra composes with the files it names "
    "before ROLL reads them; fsdp2kit reads one composed file: compose it first (hydra.compose, then OmegaConf.save) "
    "and give that file"
)
NOT_DIVIDING = "'sharding_size' = 8 does not divide the world size 4; valid: 'auto' or one of [1, 2, 4]"


def no_match(key: str, pattern: str, example: str) -> str:
    return f"'{key}': pattern '{pattern}' matches no module of the model (module paths look like '{example}')"


# file -> (built-in model, ranks, the plan, or the one-line refusal after "<file>: ").
EXPECTED: dict[str, tuple[str, int, dict | str]] = {
    # ROLL: RLVR, SFT, distill, LoRA, VL, MoE, agentic and PPO pipelines; the first FSDP2 role is run.
    "roll/examples/ascend_examples/qwen3_8b_rlvr_fsdp2.yaml": ("tiny-qwen3", 2, ROLL_DENSE),
    "roll/examples/ascend_examples/qwen3_30b_rlvr_fsdp2.yaml": (
        "tiny-qwen3-moe",
        2,
        "'actor_train.strategy_args.strategy_config.apply_tiled_mlp': the model's decoder layers have no dense "
        "`mlp` module to tile",
    ),
    "roll/examples/docs_examples/example_ppo.yaml": (
        "tiny-qwen3",
        2,
        "'critic.model_args.model_type' = 'trl' is not supported: fsdp2kit trains causal language models "
        "(model_type: ~) and critics (model_type: auto_token_classification); ROLL's trl value head and reward "
        "models are not",
    ),
    "roll/examples/qwen2.5-7B-agentic_megatron/agentic_val_webshop_amd.yaml": ("tiny-qwen3", 2, HYDRA),
    "roll/examples/qwen3-30BA3B-agentic_fsdp2/agentic_val_sokoban_30a3.yaml": ("tiny-qwen3-moe", 2, HYDRA),
    "roll/examples/qwen2.5-7B-rlvr_megatron/rlvr_fsdp2_sp2.yaml": ("tiny-qwen3", 2, ROLL_DENSE),
    # LoRA roles: the same FSDP plan, adapters in the layer groups (tests/test_lora.py holds the adapter plan)
    "roll/examples/qwen2.5-7B-rlvr_megatron/rlvr_lora_fsdp2.yaml": (
        "tiny-qwen3",
        2,
        {**ROLL_DENSE, "recompute_modules": []},  # disable_gradient_checkpointing: true
    ),
    "roll/examples/qwen2.5-vl-7B-distill/distill_vl_fsdp2.yaml": ("tiny-qwen2.5-vl", 2, ROLL_VL),
    "roll/examples/qwen2_5-vl-3B-rlvr_fsdp2/rlvr_fsdp2_offload.yaml": (
        "tiny-qwen2.5-vl",
        2,
        {**ROLL_VL, "frozen_modules": ["model.visual"]},
    ),
    "roll/examples/qwen3-30BA3B-rlvr_fsdp2/rlvr_config.yaml": ("tiny-qwen3-moe", 4, {**ROLL_MOE, "mesh": [4]}),
    "roll/examples/qwen3-30BA3B-rlvr_fsdp2/rlvr_config_ep.yaml": (  # [efsdp 2, ep 2]
        "tiny-qwen3-moe",
        4,
        {**ROLL_MOE_EP, "mesh": [4], "expert_mesh": [2, 2]},
    ),
    "roll/examples/qwen3-30BA3B-sft_fsdp2/sft_config.yaml": ("tiny-qwen3-moe", 2, ROLL_MOE),
    "roll/examples/qwen3-30BA3B-sft_fsdp2/sft_config_ep.yaml": (
        "tiny-qwen3-moe",
        2,
        {**ROLL_MOE_EP, "expert_mesh": [1, 2]},
    ),
    "roll/examples/qwen3-8B-rlvr_fsdp2/rlvr_config.yaml": ("tiny-qwen3", 2, ROLL_DENSE),
    "roll/examples/qwen3-8B-rlvr_fsdp2/rlvr_config_wo_cpuoffload.yaml": ("tiny-qwen3", 2, ROLL_DENSE),
    "roll/examples/qwen3.5-35BA3-sft_fsdp2/sft_config.yaml": ("tiny-qwen3.5-moe", 2, ROLL_QWEN35_MOE),
    "roll/examples/qwen3.5-35BA3-sft_fsdp2/sft_config_ep.yaml": (
        "tiny-qwen3.5-moe",
        2,
        {**ROLL_QWEN35_MOE_EP, "expert_mesh": [1, 2]},
    ),
    "roll/tests/distributed/strategy/checkpoint/fsdp_config.yaml": ("tiny-qwen3", 2, OFFLOAD_CPU),
    "roll/tests/distributed/strategy/checkpoint/fsdp_lora_config.yaml": ("tiny-qwen3", 2, OFFLOAD_CPU),
    "roll/tests/distributed/strategy/log_probs/log_probs_fsdp_config.yaml": ("tiny-qwen3", 2, OFFLOAD_CPU),
    "roll/tests/distributed/strategy/log_probs/log_probs_fsdp_cp_config.yaml": ("tiny-qwen3", 2, ROLL_DENSE),
    "roll/tests/distributed/strategy/log_probs/log_probs_fsdp_cp_rmpad_config.yaml": ("tiny-qwen3", 2, ROLL_DENSE),
    "roll/tests/distributed/strategy/log_probs/log_probs_fsdp_lora_config.yaml": ("tiny-qwen3", 2, ROLL_DENSE),
    "roll/tests/distributed/strategy/log_probs/log_probs_fsdp_vlm_cp2_config.yaml": (
        "tiny-qwen2.5-vl",
        2,
        {**ROLL_VL, "frozen_modules": ["vision_model"]},  # ROLL's name of the tower, read as model.visual
    ),
    "roll/tests/distributed/strategy/model_update/model_update_fsdp.yaml": ("tiny-qwen3", 2, OFFLOAD_CPU),
    # MindSpeed-MM fsdp2_config.yaml: module paths of its own model families; sharding_size must divide the world.
    "mindspeed_mm/examples/bagel/fsdp2_config.yaml": (  # its decoder class, named by class path, is MindSpeed-MM's own
        "tiny-qwen3",
        8,
        "'sub_modules_to_wrap': class 'Qwen2MoTDecoderLayer' matches no module of the model; its classes are "
        "['Embedding', 'Linear', 'ModuleList', 'Qwen3Attention', 'Qwen3DecoderLayer', 'Qwen3ForCausalLM', 'Qwen3MLP', "
        "'Qwen3Model', 'Qwen3RMSNorm', 'Qwen3RotaryEmbedding', 'SiLUActivation']",
    ),
    "mindspeed_mm/examples/glm4.5v/fsdp2_config.yaml": ("tiny-qwen3-vl", 4, {**MINDSPEED_VL, "prefetch": [0, 0]}),
    "mindspeed_mm/examples/hunyuanvideo_1.5/fsdp2_config.yaml": ("tiny-qwen3", 4, NOT_DIVIDING),
    "mindspeed_mm/examples/internvl3.5/fsdp2_config.yaml": (
        "tiny-qwen2.5-vl",
        4,
        no_match("sub_modules_to_wrap", "vision_model.embeddings", "model.visual"),
    ),
    "mindspeed_mm/examples/magistral-2509/fsdp2_config.yaml": (
        "tiny-qwen2.5-vl",
        4,
        no_match("sub_modules_to_wrap", "vision_tower.transformer.layers.{*}", "model.visual.patch_embed.proj"),
    ),
    "mindspeed_mm/examples/magistral-2509/fsdp2_lora_config.yaml": (
        "tiny-qwen2.5-vl",
        4,
        no_match("sub_modules_to_wrap", "vision_tower.transformer.layers.{*}", "model.visual.patch_embed.proj"),
    ),
    "mindspeed_mm/examples/qwen2.5vl/fsdp2_config.yaml": (
        "tiny-qwen2.5-vl",
        4,
        no_match("sub_modules_to_wrap", "text_decoder.output_layer", "model.visual"),
    ),
    "mindspeed_mm/examples/qwen3omni/fsdp2_config.yaml": ("tiny-qwen3-vl", 4, MINDSPEED_VL),
    "mindspeed_mm/examples/qwen3vl/fsdp2_config.yaml": ("tiny-qwen3-vl", 4, MINDSPEED_VL),
    "mindspeed_mm/examples/vace/fsdp2_config.yaml": ("tiny-qwen3", 4, NOT_DIVIDING),
    "mindspeed_mm/examples/wan2.1/fsdp2_config.yaml": (
        "tiny-qwen3",
        4,
        no_match("sub_modules_to_wrap", "predictor.blocks.{*}", "model.layers.0"),
    ),
    "mindspeed_mm/examples/wan2.2/5B/fsdp2_config.yaml": ("tiny-qwen3", 4, NOT_DIVIDING),
    "mindspeed_mm/examples/wan2.2/A14B/fsdp2_config.yaml": (
        "tiny-qwen3",
        4,
        no_match("ignored_modules", "ae", "model"),
    ),
    "mindspeed_mm/tests/st/run_configs/pretrain_wan2.2_i2v/fsdp2_config.yaml": (
        "tiny-qwen3",
        4,
        no_match("ignored_modules", "ae", "model"),
    ),
    # MindSpeed-MM native trainer files (NATIVE_CPU_SWAPS: what they need changed on this CPU machine).
    **{
        f"mindspeed_mm/examples/{name}": ("tiny-qwen3.5", 2, NATIVE_QWEN35)
        for name in (
            "qwen3_5/qwen3_5_4B_config.yaml",
            "qwen3_5/qwen3_5_9B_config.yaml",
            "qwen3_5/qwen3_5_27B_config.yaml",
            "qwen3_6/qwen3_6_27B_config.yaml",
        )
    },
    **{
        f"mindspeed_mm/examples/{name}": ("tiny-qwen3.5-moe", 2, NATIVE_QWEN35_MOE)
        for name in ("qwen3_5/qwen3_5_35B_config.yaml", "qwen3_6/qwen3_6_35B_config.yaml")
    },
    **{  # the experts split over ep 2 (EP_SCALED) are the same shard groups, on the expert mesh [efsdp 1, ep 2]
        f"mindspeed_mm/examples/{name}": ("tiny-qwen3.5-moe", 2, {**NATIVE_QWEN35_MOE, "expert_mesh": [1, 2]})
        for name in ("qwen3_5/qwen3_5_122B_config.yaml", "qwen3_5/qwen3_5_397B_config.yaml")
    },
    "mindspeed_mm/tests/st/run_configs/finetune_qwen3_5_35B/qwen3_5_35B_config.yaml": (
        "tiny-qwen3.5-moe",
        2,
        {**NATIVE_QWEN35_MOE, "prefetch": [0, 0], "expert_mesh": [1, 2]},
    ),
    "mindspeed_mm/examples/qwen3vl/qwen3vl_30B_config_v1.yaml": ("tiny-qwen3-vl-moe", 2, NATIVE_QWEN3VL),
    # Kimi-K2.5 and Step3-VL ship their own model code: tiny stand-ins of their layout, run with --trust-remote-code.
    "mindspeed_mm/examples/kimik2_5/kimik2_5_config.yaml": (
        "remote:kimi_k25",
        2,
        {**NATIVE_KIMI_K25, "expert_mesh": [1, 2]},
    ),
    "mindspeed_mm/examples/step3_vl/step3_vl_10b_config.yaml": ("remote:step3_vl", 2, NATIVE_STEP3_VL),
    "mindspeed_mm/examples/qwen3vl/qwen3vl_30B_config_v1_A5.yaml": ("tiny-qwen3-vl-moe", 2, NATIVE_QWEN3VL),
    "mindspeed_mm/tests/st/run_configs/finetune_qwen3vl_30B/qwen3vl_30B_config_v1.yaml": (
        "tiny-qwen3-vl-moe",
        2,
        {**NATIVE_QWEN3VL_EP, "frozen_modules": [], "expert_mesh": [1, 2]},
    ),
    # Accelerate and TRL `accelerate config` files.
    "accelerate/examples/config_yaml_templates/fsdp.yaml": ("tiny-llama", 2, ACCELERATE_LAYERS),
    "accelerate/examples/slurm/fsdp_config.yaml": ("tiny-llama", 2, FULL_PRECISION),
    # Context parallel over all of its 8 processes (model.context_parallel_size 8), FSDP over dp_shard x cp ranks.
    "accelerate/examples/torch_native_parallelism/configs/cp.yaml": ("tiny-llama", 8, {**ACCELERATE_CP, "mesh": [8]}),
    # At its 8 processes: HSDP [ddp 2, fsdp 2] beside tensor parallelism 2 (mesh [ddp, fsdp, tp]).
    "accelerate/examples/torch_native_parallelism/configs/tp_hsdp.yaml": (
        "tiny-llama",
        8,
        {**ACCELERATE_LAYERS, "mesh": [2, 2, 2]},
    ),
    "accelerate/tests/test_configs/latest_fsdp.yaml": (
        "tiny-llama",
        2,
        "'fsdp_config.fsdp_transformer_layer_cls_to_wrap': class 'BertLayer' matches no module of the model; its "
        "classes are ['Embedding', 'Linear', 'LlamaAttention', 'LlamaDecoderLayer', 'LlamaForCausalLM', 'LlamaMLP', "
        "'LlamaModel', 'LlamaRMSNorm', 'LlamaRotaryEmbedding', 'ModuleList', 'SiLUActivation']",
    ),
    "accelerate/tests/tp/fsdp2_tp_preparation_config.yaml": ("tiny-llama", 2, ROOT_ONLY),
    "trl/examples/accelerate_configs/context_parallel_2gpu.yaml": ("tiny-llama", 2, ACCELERATE_CP),
    "trl/examples/accelerate_configs/fsdp1.yaml": ("tiny-llama", 2, {**ACCELERATE_LAYERS, "prefetch": [1, 1]}),
    "trl/examples/accelerate_configs/fsdp2.yaml": ("tiny-llama", 2, ACCELERATE_LAYERS),
    "trl/tests/distributed/data/accelerate_configs/fsdp2.yaml": ("tiny-llama", 2, ROOT_ONLY),
    # Trainer fsdp_config JSON files (`--fsdp_config fsdp_config.json`): TrainingArguments reads version-2 keys only.
    "trainer/Coldog2333__BioMed-LLaMA/fsdp_config.json": ("tiny-llama", 2, FULL_PRECISION),
    "trainer/githubutilities__alpaca_farm/fsdp_config.json": ("tiny-llama", 2, FULL_PRECISION),
    "trainer/kv-wang__Qwen_limo/fsdp_config.json": ("tiny-llama", 2, FULL_PRECISION),  # offload_params: not read
    "trainer/cambrian-mllm__cambrian/fsdp_config.json": (
        "tiny-llama",
        2,
        "'xla' = True is not supported: PyTorch/XLA FSDP is not available in fsdp2kit, which runs PyTorch FSDP2 on "
        "CUDA or CPU; drop it",
    ),
}


_REMOTE_FOLDERS: dict[str, Path] = {}


def remote_code_folder(name: str) -> Path:
    """A model folder shipping its own code (tests/fixtures/remote_code/NAME: config.json's auto_map names it) with
    the built-in tokenizer and no weights; made once per test session."""
    import shutil
    import tempfile

    from fsdp2kit.data.builtin import tokenizer_dir

    if name not in _REMOTE_FOLDERS:
        folder = Path(tempfile.mkdtemp(prefix="fsdp2kit-remote-")) / name
        shutil.copytree(REPO / "tests/fixtures/remote_code" / name, folder)
        for file in tokenizer_dir().iterdir():
            shutil.copy(file, folder / file.name)
        _REMOTE_FOLDERS[name] = folder
    return _REMOTE_FOLDERS[name]


def model_swaps(model: str) -> list[str]:
    """`builtin:NAME`, or `remote:NAME`: a folder with its own code (planned on fresh weights)."""
    if model.startswith("remote:"):
        return [f"model.name_or_path={remote_code_folder(model.split(':', 1)[1])}", "model.allow_random_init=true"]
    return [f"model.name_or_path=builtin:{model}"]


def user_args(name: str, model: str, ranks: int) -> tuple[str, list[str], str | None]:
    """What a user types: a ROLL file is the config itself; a strategy file goes beside a job with --fsdp-config."""
    # The files' models and data are not on this machine (`check` refuses a data file that is missing): built-ins.
    swaps = [
        *model_swaps(model),
        f"device_mapping={list(range(ranks))}",
        "data.source=builtin:corpus",
    ]
    if name.startswith("roll/") and model not in BUILTIN_VL_MODELS:  # the stand-in keeps the real Qwen's context
        swaps.append(f"model.config.max_position_embeddings={REAL_CONTEXT}")
    swaps += EP_SCALED.get(name, [])
    if name.startswith("roll/"):
        return str(CORPUS / name), swaps, None
    if mindspeed_native.is_native_file(yaml.safe_load((CORPUS / name).read_text())):
        return str(CORPUS / name), swaps + NATIVE_CPU_SWAPS.get(name, []), None
    return JOB, swaps, str(CORPUS / name)


def plan_or_refusal(name: str, model: str, ranks: int) -> dict | str:
    """`check --json` of one file, in this process: the plan's fields, or the one-line refusal."""
    config, swaps, strategy_file = user_args(name, model, ranks)
    cfg = None
    try:
        cfg = load_config(config, swaps, strategy_file=strategy_file, trust_remote_code=model.startswith("remote:"))
        with process_group(ranks) as runtime:
            plan = describe(cfg, runtime)
    except UserError as error:
        return name_as_written(str(error), cfg) if cfg else str(error)
    mixed = plan["mixed_precision"]
    split = plan["expert_parallel"]  # the experts' mesh ([efsdp, ep] or [eddp, efsdp, ep]) under expert parallelism
    experts = {"expert_mesh": split["mesh"]["shape"]} if split else {}
    return experts | {
        "mesh": plan["mesh"]["shape"],
        "sharded_modules": plan["sharded_modules"],
        "reshard_after_forward": plan["reshard_after_forward"],
        "mixed_precision": [mixed[k] for k in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")],
        "offload": [plan["offload"], plan["pin_memory"]],
        "recompute_modules": plan["recompute_modules"],
        "activation_offload_modules": plan["activation_offload_modules"],
        "prefetch": [plan["prefetch"]["forward"], plan["prefetch"]["backward"]],
        "frozen_modules": plan["frozen_modules"],
    }


def test_the_corpus_is_the_manifest_and_holds_60_real_files():
    files = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*") if p.is_file() and p.name != "MANIFEST.yaml"}
    assert files == set(MANIFEST) == set(EXPECTED)
    assert len(files) >= 60
    assert all(len(entry["commit"]) == 40 and entry["repo"] and entry["path"] for entry in MANIFEST.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_config_gives_the_source_tools_plan(name):
    model, ranks, expected = EXPECTED[name]
    if expected == OFFLOAD_CPU and not CPU_ONLY:
        pytest.skip("on a CUDA machine the offloaded plan is held by test_roll_offload_is_pinned")
    actual = plan_or_refusal(name, model, ranks)
    if isinstance(expected, str):
        assert actual == f"{CORPUS / name}: {expected}"
    else:
        assert actual == expected


@pytest.mark.parametrize("name", [n for n, (_, _, e) in EXPECTED.items() if e == OFFLOAD_CPU])
def test_roll_offload_is_pinned(name):
    """ROLL's CPUOffloadPolicy always pins host memory: the resolved config says so before the machine is asked."""
    config, swaps, _ = user_args(name, "tiny-qwen3", 2)
    strategy = load_config(config, swaps).strategy_args.strategy_config
    assert (strategy.offload_policy, strategy.pin_memory) == (True, True)


def test_every_ignored_or_mapped_key_is_in_checks_notes():
    """A ROLL SFT file: its SFT keys drive prompt/response masking, and what ROLL does that fsdp2kit does not is
    a note, never silence."""
    config, swaps, _ = user_args("roll/examples/qwen3-30BA3B-sft_fsdp2/sft_config.yaml", "tiny-qwen3-moe", 2)
    cfg = load_config(config, swaps)
    assert (cfg.data.prompt_key, cfg.data.query_key, cfg.data.response_key) == ("instruction", "input", "output")
    notes = "\n".join(cfg.notes)
    for key in ("sft_train.data_args.template", "validation", "sft_train.use_sequence_packing"):
        assert key in notes, key
    # ROLL's SFT pipeline evaluates the loss on the validation file every eval_steps
    assert (cfg.training.eval_steps, cfg.data.eval_source) == (100, "./data/code_alpaca_500.json")
    assert "mapped validation.data_args.file_name → data.eval_source" in notes
    assert "ROLL default sft_train.strategy_args.strategy_config.cast_forward_inputs=False" in notes


@pytest.mark.slow
def test_check_json_command_line_on_real_files(tmp_path):
    """The real command line, one file per dialect: same plan as in-process."""
    for name in (
        "roll/examples/qwen3-8B-rlvr_fsdp2/rlvr_config.yaml",
        "trainer/kv-wang__Qwen_limo/fsdp_config.json",
    ):
        model, ranks, expected = EXPECTED[name]
        config, swaps, strategy_file = user_args(name, model, ranks)
        args = [config, *[item for swap in swaps for item in ("--set", swap)], "--json"]
        result = run_cli("check", *args, *(["--fsdp-config", strategy_file] if strategy_file else []))
        assert result.returncode == 0, result.stderr
        plan = json.loads(result.stdout.strip().splitlines()[-1])
        assert plan["world_size"] == ranks
        assert plan["sharded_modules"] == expected["sharded_modules"]


def test_strategy_file_given_as_the_job_config_says_where_it_goes():
    path = CORPUS / "mindspeed_mm/examples/qwen3vl/fsdp2_config.yaml"
    with pytest.raises(UserError) as error:
        load_config(path)
    assert str(error.value) == (
        f"'{path}' is a MindSpeed-MM fsdp2_config (FSDP settings only), not a job config: give it with --fsdp-config "
        f"{path} beside a job config such as examples/demo.yaml"
    )


def test_trainer_fsdp_config_as_a_json_path(tmp_path):
    json_file = CORPUS / "trainer/Coldog2333__BioMed-LLaMA/fsdp_config.json"
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {"strategy_args": {"strategy_config": {"fsdp": "full_shard auto_wrap", "fsdp_config": str(json_file)}}}
        )
    )
    strategy = load_config(job).strategy_args.strategy_config
    assert strategy.wrap_policy.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert strategy.sharding_strategy == "FULL_SHARD"


@pytest.mark.slow
def test_a_run_keeps_the_config_as_given_and_as_resolved(small_run, tmp_path):
    result = run_cli("train", "examples/mindspeed_job.yaml", *small_run, "--set", "training.max_steps=1")
    assert result.returncode == 0, result.stderr
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["strategy_args"]["strategy_config"]["fsdp_size"] == "auto"
    for given in ("examples/mindspeed_job.yaml", "examples/mindspeed_fsdp2_config.yaml"):
        assert (run / "config.given" / Path(given).name).read_text() == (REPO / given).read_text()


def test_docs_table_every_key_of_every_dialect():
    """docs/dialects.md names each key a reader knows (mapped, ignored or refused), so the table cannot fall behind."""
    from fsdp2kit.config.dialects import accelerate, mindspeed, roll
    from fsdp2kit.config.dialects import mindspeed_native as native

    docs = (REPO / "docs/dialects.md").read_text()
    tables = [
        roll.TOP_LEVEL,
        roll.SFT_TOP_LEVEL,
        roll.ROLE,
        roll.MODEL_ARGS,
        roll.TRAINING_ARGS,
        roll.DATA_ARGS,
        roll.STRATEGY_ARGS,
        roll.STRATEGY_CONFIG_RULES,
        roll.WRAP_POLICY_RULES,
        mindspeed.RULES,
        *(getattr(native, table) for table in ("PARALLEL", "FSDP_PLAN", "EP_PLAN", "FEATURES", "LOSS_CFG", "MODEL")),
        native.ATTR,
        *(getattr(native, table) for table in ("BASIC_PARAMETERS", "PREPROCESS_PARAMETERS", "DATASET_PARAM")),
        *(getattr(native, table) for table in ("DATALOADER_PARAM", "DATA", "TRAINING", "TOOLS")),
        accelerate.ACCELERATE_CONFIG,
        accelerate.FSDP_CONFIG,
        accelerate.PARALLELISM,
        accelerate.TRAINER_FSDP_CONFIG,
    ]
    missing = [key for table in tables for key in table if f"`{key}`" not in docs and f".{key}`" not in docs]
    assert not missing, missing


@pytest.mark.parametrize(("name", "swap"), [(n, swap) for n, swaps in NATIVE_CPU_SWAPS.items() for swap in swaps])
def test_native_file_as_written_is_refused_naming_the_key(name, swap):
    """What these files ask for and fsdp2kit cannot give on this machine is one line naming the file's key."""
    config, swaps, _ = user_args(name, EXPECTED[name][0], 2)
    with pytest.raises(UserError) as error:
        load_config(config, [s for s in swaps if s != swap])
    assert str(error.value).startswith(f"{CORPUS / name}: '{swap.split('=')[0]}")


@pytest.mark.parametrize("name", sorted(EP_SCALED))
def test_expert_parallel_file_as_written_is_refused_naming_its_key(name, monkeypatch):
    """Unscaled, the files' expert-parallel sizes do not divide the 2-4 ranks here: one line naming the file's key."""
    model, ranks, _ = EXPECTED[name]
    monkeypatch.delitem(EP_SCALED, name)
    key = (
        "parallel.expert_parallel_size" if name.startswith("mindspeed_mm/") else "strategy_args.strategy_config.ep_size"
    )
    refusal = plan_or_refusal(name, model, ranks)
    assert isinstance(refusal, str) and refusal.startswith(f"{CORPUS / name}: '")
    assert f"{key}' = " in refusal and f"does not divide the world size {ranks}" in refusal


# The expert-parallel files trained: ROLL's SFT files on Alpaca records (their prompt/query/response keys), its RLVR
# file on `messages` conversations, MindSpeed-MM's on LLaMA-Factory image+text conversations. Changed besides EP_SCALED:
# - the RLVR file at 2 ranks: efsdp 2 -> 1, Ulysses 4 -> 2; its qwen2_5 template (under ROLL the tokenizer's own) is
#   given as Qwen's ChatML in data.chat_template, as the stand-in's tokenizer has none;
# - the Qwen3-30B-A3B SFT file: its validation data is the same records;
# - the Qwen3.5 SFT file: template qwen2_5 named as Qwen3.5's (fsdp2kit reads ROLL's template names as families) and
#   no packing (fsdp2kit packs no vision-language model's samples).
EP_TRAINED: dict[str, tuple[str, list[str]]] = {
    "roll/examples/qwen3-30BA3B-sft_fsdp2/sft_config_ep.yaml": (
        "alpaca.json",
        ["validation.data_args.file_name={data}"],
    ),
    "roll/examples/qwen3.5-35BA3-sft_fsdp2/sft_config_ep.yaml": (
        "alpaca.json",
        ["sft_train.data_args.template=qwen3_5", "sft_train.use_sequence_packing=false"],
    ),
    "roll/examples/qwen3-30BA3B-rlvr_fsdp2/rlvr_config_ep.yaml": (
        "messages.jsonl",
        [
            f"{ROLL_STRATEGY.format('actor_train')}.efsdp_size=1",
            "actor_train.model_args.ulysses_size=2",
            "data.chat_template={folder}/chatml.jinja",
        ],
    ),
    **{
        name: ("vl/llamafactory.json", [])
        for name in EP_SCALED
        if name.startswith("mindspeed_mm/") and "kimi" not in name
    },
    # Kimi-K2.5's stand-in reads text only: `messages` conversations rendered with ChatML (its tokenizer has no
    # template; fsdp2kit knows no template named kimi_k25, so the file's name is dropped)
    "mindspeed_mm/examples/kimik2_5/kimik2_5_config.yaml": (
        "messages.jsonl",
        ["data.chat_template={folder}/chatml.jinja", "data.dataset_param.basic_parameters.template=null"],
    ),
}


def saved_builtin(folder: Path, name: str) -> Path:
    """A built-in model saved as transformers initialises it (from_config, save_pretrained), with its tokenizer and
    processor: a folder of weights, as a user's would be."""
    import shutil

    from transformers import AutoConfig

    from fsdp2kit.models.vl import auto_model_class, builtin_tokenizer_dir

    settings = dict(BUILTIN_VL_MODELS[name])
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(3)
    auto_model_class(hf_config).from_config(hf_config).save_pretrained(folder / name)
    for file in builtin_tokenizer_dir(hf_config).iterdir():
        shutil.copy(file, folder / name / file.name)
    return folder / name


def saved_remote(folder: Path, name: str) -> Path:
    """A stand-in shipping its own code (remote_code_folder) with weights as transformers initialises them."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    saved = folder / name
    shutil.copytree(remote_code_folder(name), saved)
    hf_config = AutoConfig.from_pretrained(saved, trust_remote_code=True)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(hf_config, trust_remote_code=True).save_pretrained(saved)
    return saved


def ep_training_data(folder: Path) -> None:
    """Alpaca records, `messages` conversations and LLaMA-Factory image+text conversations, in `folder`."""
    sys.path.insert(0, str(REPO / "examples"))
    from make_vl_dataset import main as make_dataset

    make_dataset(folder / "vl", 8, 0)
    alpaca = [{"instruction": f"Add {i} and {i}.", "input": str(i) * (i % 2), "output": str(2 * i)} for i in range(64)]
    (folder / "alpaca.json").write_text(json.dumps(alpaca))
    turns = [
        [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]
        for i in range(64)
    ]
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (folder / "chatml.jinja").write_text(chatml)
    (folder / "messages.jsonl").write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns))


@pytest.mark.slow
def test_expert_parallel_files_train_two_steps_on_two_ranks(tmp_path):
    """ROLL's and MindSpeed-MM's expert-parallel files as written (EP_TRAINED says what is scaled), their stand-in
    models and data of their kinds: 2 optimizer steps each on 2 ranks, one launch for all, every MoE layer's experts
    split over the files' ep (2) as DTensors on the expert mesh."""
    from conftest import launch_two_ranks, read_metrics

    ep_training_data(tmp_path)
    qwen35_moe, kimi = saved_builtin(tmp_path, "tiny-qwen3.5-moe"), saved_remote(tmp_path, "kimi_k25")
    runs = []
    for i, (name, (data, scaled)) in enumerate(EP_TRAINED.items()):
        model = EXPECTED[name][0]
        config, swaps, _ = user_args(name, model, 2)
        saved = {
            "tiny-qwen3.5-moe": [f"model.name_or_path={qwen35_moe}"],
            "remote:kimi_k25": [f"model.name_or_path={kimi}"],
        }
        settings = [
            *swaps,
            *saved.get(model, []),
            *(item.format(data=tmp_path / data, folder=tmp_path) for item in scaled),
            f"data.source={tmp_path / data}",
            "data.seq_len=128",
            "training.max_steps=2",
            f"training.output_dir={tmp_path / f'run{i}'}",
            "training.export_hf=false",
            "training.report_to=[]",
        ]
        runs.append({"config": config, "set": settings, "trust_remote_code": model.startswith("remote:")})
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    launch_two_ranks("real_configs_worker.py", tmp_path / "runs.json")
    for i, name in enumerate(EP_TRAINED):
        steps = read_metrics(tmp_path / f"run{i}")
        assert [s["step"] for s in steps] == [1, 2], name
        assert all(s["loss"] > 0 and s["grad_norm"] > 0 for s in steps), name
        split = json.loads((tmp_path / f"run{i}" / "experts.json").read_text())
        assert split and all(key.rsplit(".", 2)[-2] == "experts" for key in split), (name, split)
        assert {json.dumps(mesh) for mesh in split.values()} == {json.dumps({"mesh": ["efsdp", "ep"], "shape": [1, 2]})}


def test_native_file_training_keys_field_by_field():
    """Qwen3.5-35B's file: MindSpeed-MM's training, data and feature keys as its trainer reads them."""
    name = "mindspeed_mm/examples/qwen3_5/qwen3_5_35B_config.yaml"
    config, swaps, _ = user_args(name, "tiny-qwen3.5-moe", 2)
    cfg = load_config(config, [*swaps, "parallel.ulysses_parallel_size=2"])
    training, strategy = cfg.training, cfg.strategy_args.strategy_config
    assert (training.learning_rate, training.lr_scheduler_type, training.warmup_ratio) == (1.0e-5, "cosine", 0.1)
    assert (training.max_steps, training.max_grad_norm, training.per_device_train_batch_size) == (10000, 0.0, 4)
    assert (training.gradient_accumulation_steps, training.seed, training.weight_decay) == (1, 42, 0)
    assert (training.output_dir, training.save_steps, training.loss_chunk_tokens) == ("./save_path", 10000, 512)
    assert (cfg.data.seq_len, cfg.data.pack, cfg.data.shuffle) == (16384, False, True)
    assert (cfg.model.attn_implementation, cfg.model.init_on_meta, cfg.model.ulysses_size) == (
        "flash_attention_2",
        True,
        2,
    )
    assert (strategy.use_reentrant, strategy.fsdp_size, strategy.fsdp_size_exact) == (False, "auto", False)
    assert (training.eval_steps, training.per_device_eval_batch_size, cfg.data.eval_fraction) == (0, 1, None)
    notes = "\n".join(cfg.notes)
    for key in ("parallel.fsdp_plan.hook_modules", "features.enable_chunk_mbs", "model.gdn_implementation", "mtp"):
        assert key in notes, key


def test_native_file_val_size_and_val_interval_are_the_evaluation():
    """LLaMA-Factory's val_size (a fraction) is held out and evaluated every val_interval steps; a count is refused."""
    name = "mindspeed_mm/examples/qwen3_5/qwen3_5_35B_config.yaml"
    config, swaps, _ = user_args(name, "tiny-qwen3.5-moe", 2)
    evaluation = ["data.dataset_param.basic_parameters.val_size=0.05", "training.val_interval=20"]
    cfg = load_config(config, [*swaps, *evaluation])
    assert (cfg.data.eval_fraction, cfg.training.eval_steps, cfg.training.per_device_eval_batch_size) == (0.05, 20, 1)
    with pytest.raises(UserError) as error:
        load_config(config, [*swaps, "data.dataset_param.basic_parameters.val_size=100"])
    assert "val_size' = 100 is not supported" in str(error.value)


# Issue 34's seven native files: Qwen3.5 4B/9B/35B, Qwen3.6 27B, Kimi-K2.5, Qwen3-VL 30B, Step3-VL 10B.
SEVEN_NATIVE = [
    f"mindspeed_mm/examples/{name}"
    for name in (
        "qwen3_5/qwen3_5_4B_config.yaml",
        "qwen3_5/qwen3_5_9B_config.yaml",
        "qwen3_5/qwen3_5_35B_config.yaml",
        "qwen3_6/qwen3_6_27B_config.yaml",
        "kimik2_5/kimik2_5_config.yaml",
        "qwen3vl/qwen3vl_30B_config_v1.yaml",
        "step3_vl/step3_vl_10b_config.yaml",
    )
]


def _value_at(node: object, key: str) -> object:
    for part in key.split("."):
        node = node[part]  # type: ignore[index]
    return node


def _leaf_keys(node: object, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [key for k, v in node.items() for key in _leaf_keys(v, f"{prefix}.{k}" if prefix else str(k))]
    return [prefix]


@pytest.mark.parametrize("name", SEVEN_NATIVE)
def test_every_key_of_the_native_files_is_applied_or_noted(name):
    """Each key of the file (or a section holding it) went into a native key, or check's notes name it: what it
    does, or why it is ignored. A key silently dropped would be in neither."""
    import re

    from fsdp2kit.config import dialects

    config, swaps, _ = user_args(name, EXPECTED[name][0], 2)
    translation = dialects.read_config(config, swaps)
    applied, notes = translation.written_keys(), "\n".join(translation.notes)

    def accounted(key: str) -> bool:
        parts = key.split(".")
        sections = [".".join(parts[:i]) for i in range(len(parts), 1, -1)]  # the key, then sections below the top
        return any(k in applied or re.search(rf"(?<![\w.]){re.escape(k)}(?![\w.])", notes) for k in sections)

    raw = yaml.safe_load((CORPUS / name).read_text())
    keys = _leaf_keys(raw)
    assert len(keys) > 80
    unset = [key for key in keys if _value_at(raw, key) is None]  # `max_samples: null`: not written (translation.py)
    assert [key for key in keys if not accounted(key) and key not in unset] == []


def test_chunk_loss_module_names_the_lm_head_or_is_refused():
    """chunkloss_plan.apply_module: the LM head as MindSpeed-MM's models name it is the model's LM head (Kimi-K2.5's
    language_model.lm_head plans above); a module that is not the output embeddings is one line."""
    name = "mindspeed_mm/examples/qwen3_5/qwen3_5_4B_config.yaml"
    config, swaps, _ = user_args(name, "tiny-qwen3.5", 2)
    cfg = load_config(config, [*swaps, "features.chunkloss_plan.apply_module=thinker.lm_head"])
    assert cfg.training.loss_chunk_tokens == 1024
    assert "chunkloss_plan.apply_module='thinker.lm_head', read as the model's LM head" in "\n".join(cfg.notes)
    with pytest.raises(UserError) as refused:
        load_config(config, [*swaps, "features.chunkloss_plan.apply_module=model.language_model.norm"])
    assert str(refused.value) == (
        f"{CORPUS / name}: 'features.chunkloss_plan.apply_module' = 'model.language_model.norm' is not supported: "
        "fsdp2kit chunks the output embeddings (lm_head), named as MindSpeed-MM's models name them: lm_head, "
        "language_model.lm_head, thinker.lm_head, output_layer"
    )


def test_activation_offload_on_a_cpu_is_one_note():
    name = "mindspeed_mm/examples/qwen3_5/qwen3_5_4B_config.yaml"
    config, swaps, _ = user_args(name, "tiny-qwen3.5", 2)
    with process_group(2) as runtime:
        plan = describe(load_config(config, swaps), runtime)
    offload_notes = [note for note in plan["notes"] if note.startswith("activation_offload_modules")]
    assert offload_notes == [
        "activation_offload_modules (4 modules): a no-op on cpu, where activations already live in host memory"
    ]


@pytest.mark.parametrize("name", [n for n, (model, _, _) in EXPECTED.items() if model.startswith("remote:")])
def test_a_model_needing_its_own_code_is_refused_though_the_file_trusts_it(name):
    """Kimi-K2.5's and Step3-VL's files write trust_remote_code: true (model and processor): read, noted, and no
    code runs; the model folder is refused in one line naming its class."""
    model = EXPECTED[name][0]
    config, swaps, _ = user_args(name, model, 2)
    cfg = load_config(config, swaps)
    notes = "\n".join(cfg.notes)
    assert "model.trust_remote_code=True: read; a config file never turns on code execution" in notes
    assert "preprocess_parameters.trust_remote_code=True: read; a config file never turns on code" in notes
    with pytest.raises(UserError) as refused, process_group(2) as runtime:
        describe(cfg, runtime)
    folder = remote_code_folder(model.split(":", 1)[1])
    assert str(refused.value).startswith(f"model.name_or_path: '{folder}' needs its own code (modeling_")


@pytest.mark.slow
def test_check_runs_a_model_folders_code_with_trust_remote_code_on_the_command_line():
    """The flag reaches the build (without it the folder is refused: the in-process test above) and check says so."""
    name = "mindspeed_mm/examples/kimik2_5/kimik2_5_config.yaml"
    config, swaps, _ = user_args(name, "remote:kimi_k25", 1)
    swaps.append("parallel.expert_parallel_size=1")  # one rank: its experts are not split
    args = [config, *[item for swap in swaps for item in ("--set", swap)], "--json"]
    result = run_cli("check", *args, "--trust-remote-code")
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["sharded_modules"] == NATIVE_KIMI_K25["sharded_modules"]
    assert any("on from the caller (--trust-remote-code)" in note for note in plan["config_notes"])


@pytest.mark.slow
def test_native_qwen35_file_trains_two_steps_on_two_ranks(tmp_path):
    """MindSpeed-MM's Qwen3.5-4B file as written (its activation offload a no-op on this CPU, noted), a tiny Qwen3.5
    and image+text conversations in LLaMA-Factory's form (the form its `dataset_param.attr` names: `messages` with
    `<image>` and an `images` list): 2 optimizer steps on 2 ranks, its recompute, bf16/fp32 precision and chunked
    loss included."""
    sys.path.insert(0, str(REPO / "examples"))
    from make_vl_dataset import main as make_dataset

    make_dataset(tmp_path, 8, 0)
    name = "mindspeed_mm/examples/qwen3_5/qwen3_5_4B_config.yaml"
    settings = [
        "model.name_or_path=builtin:tiny-qwen3.5",
        f"data.source={tmp_path / 'llamafactory.json'}",
        "data.seq_len=256",
        "training.max_steps=2",
        f"training.output_dir={tmp_path / 'run'}",
        "training.export_hf=false",
        "training.report_to=[]",
    ]
    result = run_cli("train", CORPUS / name, "--nproc", 2, *(a for s in settings for a in ("--set", s)), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["loss"] > 0 and s["grad_norm"] > 0 for s in steps)


# ROLL files whose training role names `messages` data and a chat template, one per model family.
ROLL_MESSAGES = {
    "roll/examples/qwen3-8B-rlvr_fsdp2/rlvr_config.yaml": "qwen3",
    "roll/examples/qwen2.5-7B-rlvr_megatron/rlvr_lora_fsdp2.yaml": "qwen2",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ROLL_MESSAGES))
def test_roll_files_naming_messages_data_and_a_template_train_a_step_on_it(name, tmp_path):
    """The file as written (its template, `messages`, batch and accumulation) on a tiny model of the family whose
    tokenizer has its chat template, and a messages jsonl; only the model, the data path and the context are swapped
    (and one rank: 32 conversations a step)."""
    from conftest import make_hf_folder, read_metrics
    from test_chat import family_tokenizer

    from fsdp2kit.data.builtin import VOCAB_SIZE
    from fsdp2kit.trainer import train

    model = tmp_path / "model"
    make_hf_folder(model, "tiny-qwen3", model_type=ROLL_MESSAGES[name], vocab_size=VOCAB_SIZE + 64)
    family_tokenizer("qwen2.5").save_pretrained(model)
    data = tmp_path / "messages.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(32)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    swaps = [
        f"model.name_or_path={model}",
        "device_mapping=[0]",
        f"data.source={data}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.seq_len=64",
        "training.max_steps=1",
        f"training.output_dir={tmp_path / 'run'}",
        "training.export_hf=false",
    ]
    cfg = load_config(CORPUS / name, swaps)
    assert cfg.data.template in ("qwen3", "qwen2_5") and cfg.data.messages_key == "messages"
    with process_group() as runtime:
        train(cfg, runtime)
    assert len(read_metrics(tmp_path / "run")) == 1
    wrong = load_config(CORPUS / name, [*swaps, "data.template=llama3"])
    with pytest.raises(UserError, match="data.template: 'llama3' is not the chat template of this model"):
        with process_group() as runtime:
            train(wrong, runtime)


def test_set_of_a_native_files_own_key_replaces_it():
    """Issue 42 (8): `--set model.model_name_or_path=X` on a MindSpeed-MM native file (its own key, and a native
    alias) stood beside the translated model.name_or_path: 'expected only one of ...'. A key the file writes is
    changed in the file, as the file's own spelling; a native key it does not write still sets the native key."""
    name = "mindspeed_mm/examples/qwen3_5/qwen3_5_9B_config.yaml"
    config, swaps, _ = user_args(name, "tiny-qwen3.5", 2)
    model = "builtin:tiny-qwen3.5"
    own = [s for s in swaps if not s.startswith("model.name_or_path=")] + [
        f"model.model_name_or_path={model}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model}",
        "training.load=null",  # the file's weights, read from the model folder it names (as MindSpeed-MM does)
    ]
    as_own, as_native = load_config(config, own), load_config(config, swaps)
    assert as_own.model.name_or_path == as_native.model.name_or_path == model
    assert as_own.data.tokenizer == as_native.data.tokenizer
    roll = "examples/roll_rlvr.yaml"  # ROLL's own keys likewise: the file's value, as the file would give it
    cfg = load_config(REPO / roll, ["pretrain=builtin:tiny-llama", "actor_train.training_args.learning_rate=3e-5"])
    assert (cfg.model.name_or_path, cfg.training.learning_rate) == ("builtin:tiny-llama", 3e-5)
    with pytest.raises(UserError, match="unknown key 'foo'"):  # a typo is not a key of the file: refused as before
        load_config(REPO / roll, ["foo=1"])


def _trained_weights(cfg) -> dict[str, torch.Tensor]:
    """Train `cfg` on one rank in this process; its HF export's tensors."""
    from safetensors.torch import load_file

    from fsdp2kit.trainer import train

    with process_group() as runtime:
        train(cfg, runtime)
    hf = Path(cfg.training.output_dir) / "hf"
    return {key: value for file in sorted(hf.glob("*.safetensors")) for key, value in load_file(file).items()}


@pytest.mark.slow
def test_native_file_decays_every_parameter_as_mindspeed_mm_does(tmp_path):
    """Issue 53 (3): MindSpeed-MM's build_optimizer decays every parameter (no_decay_modules and no_decay_params
    empty), so its file with weight_decay 0.1 trains as the native config that says weight_decay_every_parameter:
    true (1e-6), and otherwise than one leaving biases and norms undecayed (the old reading)."""
    sys.path.insert(0, str(REPO / "examples"))
    from make_vl_dataset import main as make_dataset

    make_dataset(tmp_path, 4, 0)
    name = "mindspeed_mm/examples/qwen3_5/qwen3_5_4B_config.yaml"
    settings = [
        "model.name_or_path=builtin:tiny-qwen3.5",
        "device_mapping=[0]",
        f"data.source={tmp_path / 'llamafactory.json'}",
        "data.seq_len=128",
        "training.micro_batch_size=2",
        "training.train_iters=2",
        "training.lr=1.0e-2",
        "training.weight_decay=0.1",
        "training.export_hf=true",
        "training.report_to=[]",
    ]
    from_file = load_config(CORPUS / name, [*settings, f"training.output_dir={tmp_path / 'file'}"])
    assert from_file.training.weight_decay_every_parameter is True
    assert "training.weight_decay_every_parameter=True: MindSpeed-MM decays every parameter" in "\n".join(
        from_file.notes
    )
    file_weights = _trained_weights(from_file)
    resolved = tmp_path / "file" / "config.json"  # the run's resolved native config
    weights = {}
    for every in (True, False):
        native = load_config(
            resolved,
            [
                f"training.weight_decay_every_parameter={str(every).lower()}",
                f"training.output_dir={tmp_path / str(every)}",
            ],
        )
        weights[every] = _trained_weights(native)
    assert file_weights.keys() == weights[True].keys()
    assert max((file_weights[k].float() - weights[True][k].float()).abs().max().item() for k in file_weights) <= 1e-6
    norms = [k for k in file_weights if k.endswith("norm.weight")]
    assert norms and max((file_weights[k].float() - weights[False][k].float()).abs().max().item() for k in norms) > 1e-4


# Issue 48's acceptance: the real files asking for context parallelism, planned and trained as written.
# Accelerate's cp.yaml asks for 8 processes (cp 8): planned at 8, trained with its cp scaled to the 2 ranks here
# through its own key; TRL's file (cp 2) as written; MindSpeed-MM's native files with ring_attention_size: 2 (their
# stand-in models).
CP_FILES = {
    "accelerate": {
        "accelerate/examples/torch_native_parallelism/configs/cp.yaml": 8,
        "trl/examples/accelerate_configs/context_parallel_2gpu.yaml": 2,
    },
    "mindspeed_vl": {
        "mindspeed_mm/examples/qwen3vl/qwen3vl_30B_config_v1.yaml": 2,
        "mindspeed_mm/examples/step3_vl/step3_vl_10b_config.yaml": 2,
    },
}
RING_2 = ["parallel.ring_attention_size=2"]


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(CP_FILES))
def test_context_parallel_files_plan_as_written(group):
    """`check` of each file: its context-parallel group is the file's size (8 for Accelerate's cp.yaml at its 8
    processes); at a world it does not divide, one line naming the key as written."""
    for name, size in CP_FILES[group].items():
        model, ranks, _ = EXPECTED[name]
        config, swaps, strategy_file = user_args(name, model, ranks)
        extra = RING_2 if name.startswith("mindspeed_mm/") else []
        cfg = load_config(config, [*swaps, *extra], strategy_file=strategy_file, trust_remote_code=True)
        assert cfg.model.context_parallel_size == size, name
        with process_group(ranks) as runtime:
            plan = describe(cfg, runtime)
        assert plan["context_parallel"]["size"] == size, name
    if group != "accelerate":
        return
    assert plan_or_refusal("accelerate/examples/torch_native_parallelism/configs/cp.yaml", "tiny-llama", 4) == (
        f"{CORPUS / 'accelerate/examples/torch_native_parallelism/configs/cp.yaml'}: "
        "'parallelism_config.parallelism_config_cp_size' = 8 does not divide world size 4 / model.ulysses_size 1; "
        "valid: 1, 2, 4; launch with --nproc 8 (or a multiple of it) for this layout"
    )


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(CP_FILES))
def test_context_parallel_files_train_two_steps(group, tmp_path):
    """Each file trains 2 optimizer steps on 2 ranks with its context-parallel group of 2 (layout.json), one launch
    for all: Accelerate's and TRL's on tiny-llama and the built-in corpus, MindSpeed-MM's Qwen3-VL on image+text
    conversations (Step3-VL's text-only stand-in on the corpus)."""
    from conftest import launch_two_ranks, read_metrics

    ep_training_data(tmp_path)
    scaled_cp = tmp_path / "cp.yaml"  # Accelerate's cp.yaml with its cp size scaled to the 2 ranks here
    written = yaml.safe_load((CORPUS / "accelerate/examples/torch_native_parallelism/configs/cp.yaml").read_text())
    written["parallelism_config"]["parallelism_config_cp_size"] = 2
    scaled_cp.write_text(yaml.safe_dump(written))
    runs = []
    for i, name in enumerate(CP_FILES[group]):
        model = EXPECTED[name][0]
        config, swaps, strategy_file = user_args(name, model, 2)
        native = name.startswith("mindspeed_mm/")  # Step3-VL's stand-in is text-only: the built-in corpus
        images = [f"data.source={tmp_path / 'vl/llamafactory.json'}"] if model in BUILTIN_VL_MODELS else []
        data = [*images, *RING_2] if native else []
        settings = [
            *swaps,
            *data,
            "data.seq_len=128",
            "training.max_steps=2",
            f"training.output_dir={tmp_path / f'run{i}'}",
            "training.export_hf=false",
            "training.report_to=[]",
        ]
        if name.endswith("/cp.yaml"):
            strategy_file = str(scaled_cp)
        runs.append(
            {"config": config, "set": settings, "strategy_file": strategy_file, "trust_remote_code": "step3" in name}
        )
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    launch_two_ranks("real_configs_worker.py", tmp_path / "runs.json")
    for i, name in enumerate(CP_FILES[group]):
        steps = read_metrics(tmp_path / f"run{i}")
        assert [s["step"] for s in steps] == [1, 2], name
        assert all(s["loss"] > 0 and s["grad_norm"] > 0 for s in steps), name
        layout = json.loads((tmp_path / f"run{i}" / "layout.json").read_text())
        assert (layout["context_parallel_size"], layout["ulysses_size"]) == (2, 1), name
