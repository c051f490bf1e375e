"""Vision-language models: any architecture transformers builds with `AutoModelForImageTextToText` (Qwen2.5-VL,
Qwen3-VL, ...), their checkpoint names, and the built-in tiny ones with a processor folder beside them.

transformers 5 holds a VL model as `model.visual.*` + `model.language_model.*` + `lm_head`, while the HF folders of
some families store other names (Qwen2.5-VL: `visual.*`, `model.layers.*`): `models/hf_layout.py` reads and writes
them through transformers' own conversions, as it does for every family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp2kit.data.builtin import VOCAB_SIZE, _locked, cache_dir, tokenizer_dir

# The tokens a Qwen-VL chat needs beyond the built-in BPE vocabulary, in id order after it.
VISION_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_TOKEN_IDS = {token: VOCAB_SIZE + i for i, token in enumerate(VISION_TOKENS)}

# Qwen's chat format: a turn is `<|im_start|>role\n...<|im_end|>\n`, an image
# `<|vision_start|><|image_pad|><|vision_end|>` (the data pipeline repeats `<|image_pad|>` once per merged patch).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE + 16,  # the BPE vocabulary, the vision tokens, room to spare
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": _TOKEN_IDS["<|im_end|>"],
    "pad_token_id": 2,
}
_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 128,
}
_SPECIAL_IDS = {
    "image_token_id": _TOKEN_IDS["<|image_pad|>"],
    "video_token_id": _TOKEN_IDS["<|video_pad|>"],
    "vision_start_token_id": _TOKEN_IDS["<|vision_start|>"],
    "vision_end_token_id": _TOKEN_IDS["<|vision_end|>"],
}

# head_dim 32: the three rotary sections (time, height, width) share its 16 frequencies.
BUILTIN_VL_MODELS: dict[str, dict[str, Any]] = {
    "tiny-qwen2.5-vl": {
        "model_type": "qwen2_5_vl",
        "text_config": {
            **_TEXT,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]},
        },
        "vision_config": {**_VISION, "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]},
        "tie_word_embeddings": False,
        **_SPECIAL_IDS,
    },
    "tiny-qwen3-vl": {
        "model_type": "qwen3_vl",
        "text_config": {
            **_TEXT,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
        },
        "vision_config": {**_VISION, "patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        "tie_word_embeddings": False,
        **_SPECIAL_IDS,
    },
}
# The families of MindSpeed-MM's native trainer examples: Qwen3-VL-MoE (fused experts), Qwen3.5 (a linear-attention
# layer, then a full-attention one) and Qwen3.5-MoE (both, with a shared expert). Qwen3.6 is Qwen3.5's architecture.
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
_LINEAR_ATTENTION = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
_QWEN3_VL = BUILTIN_VL_MODELS["tiny-qwen3-vl"]
BUILTIN_VL_MODELS.update(
    {
        "tiny-qwen3-vl-moe": {
            **_QWEN3_VL,
            "model_type": "qwen3_vl_moe",
            "text_config": {**_QWEN3_VL["text_config"], **_MOE, "decoder_sparse_step": 1},
        },
        "tiny-qwen3.5": {
            **_QWEN3_VL,
            "model_type": "qwen3_5",
            "text_config": {**_QWEN3_VL["text_config"], **_LINEAR_ATTENTION},
            "vision_config": {k: v for k, v in _QWEN3_VL["vision_config"].items() if k != "deepstack_visual_indexes"},
        },
        "tiny-qwen3.5-moe": {
            **_QWEN3_VL,
            "model_type": "qwen3_5_moe",
            "text_config": {
                **_QWEN3_VL["text_config"],
                **_LINEAR_ATTENTION,
                **_MOE,
                "shared_expert_intermediate_size": 64,
            },
            "vision_config": {k: v for k, v in _QWEN3_VL["vision_config"].items() if k != "deepstack_visual_indexes"},
        },
    }
)


def is_vision_language(hf_config: Any) -> bool:
    """A config transformers builds as an image-text-to-text model, with a vision tower."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (
        getattr(hf_config, "vision_config", None) is not None
        and hf_config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    )


def builtin_processor_dir(model_type: str, patch_size: int) -> Path:
    """A folder with the built-in tokenizer plus the vision tokens, Qwen's chat template and a small-image Qwen2-VL
    image processor (images of 1 to 16 merged patches), built once per machine. `Qwen2VLImageProcessor` is the
    public name of the PIL one in every transformers 5 (5.2's own class; later an alias of `Qwen2VLImageProcessorPil`,
    which 5.2 lacks)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    path = cache_dir() / f"processor-{model_type}-v2"  # v2: the chat template keeps its newlines
    base = tokenizer_dir()
    with _locked("processor"):
        if not (path / "preprocessor_config.json").exists():
            tokenizer = AutoTokenizer.from_pretrained(base)
            tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
            tokenizer.eos_token = "<|im_end|>"
            tokenizer.chat_template = CHAT_TEMPLATE
            unit = patch_size * 2  # a merged patch: 2 x 2 patches
            image_processor = Qwen2VLImageProcessor(
                patch_size=patch_size,
                merge_size=2,
                min_pixels=unit * unit,
                max_pixels=16 * unit * unit,
                image_mean=[0.5, 0.5, 0.5],
                image_std=[0.5, 0.5, 0.5],
            )
            tmp = path.with_name(path.name + ".tmp")
            tokenizer.save_pretrained(tmp)
            image_processor.save_pretrained(tmp)
            tmp.replace(path)
    return path


def builtin_tokenizer_dir(hf_config: Any) -> Path:
    """A built-in model's tokenizer: the corpus's, or for a vision-language model one with the vision tokens and an
    image processor."""
    if is_vision_language(hf_config):
        return builtin_processor_dir(hf_config.model_type, hf_config.vision_config.patch_size)
    return tokenizer_dir()


def auto_model_class(hf_config: Any) -> Any:
    """transformers' Auto class for this config: image-text-to-text for a vision-language model, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(hf_config) else AutoModelForCausalLM
