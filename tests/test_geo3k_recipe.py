"""configs/geo3k_grpo_qwen2.5_vl_3b.yaml passes the dry run offline against a directory holding Qwen2.5-VL-3B-Instruct's
published config.json and preprocessor_config.json (no weights; the offline tokenizer with the vision tokens) and
prompt files in Geometry3K's public HF layout (images as [{bytes, path}], `problem` with an `<image>` marker,
`answer`); a row without its image is named by file and row."""

import io
import json
from pathlib import Path

from PIL import Image

from megarl.data.files import write_records
from megarl.models.tiny_vl import build_tiny_vl_tokenizer
from megarl.train import main

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "geo3k_grpo_qwen2.5_vl_3b.yaml"
# Qwen/Qwen2.5-VL-3B-Instruct's config.json as published (flat, transformers 4.x layout)
QWEN2_5_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936}
PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor"}


def _figure() -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (60, 40), "white").save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}  # as HF datasets writes an Image feature


def test_geo3k_recipe_dry_run_with_the_published_3b_config(tmp_path, capsys):
    model = tmp_path / "Qwen2.5-VL-3B-Instruct"
    build_tiny_vl_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(json.dumps(QWEN2_5_VL_3B))
    (model / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    rows = [{"images": [_figure()], "problem": "<image>Find x. Round to the nearest tenth.", "answer": "3.5"},
            {"images": [_figure()], "problem": "<image>Find the area of the figure.", "answer": "12\\sqrt{3}"}]
    good, bad = tmp_path / "train.parquet", tmp_path / "bad.parquet"
    write_records(good, rows)
    write_records(bad, [rows[0], dict(rows[1], images=[])])
    args = ["--config", str(RECIPE), "--dry-run", f"model.path={model}", f"data.task={good}", f"data.val_task={good}",
            f"trainer.output_dir={tmp_path / 'run'}"]
    capsys.readouterr()
    assert main(args) == 0, capsys.readouterr().err
    assert "prompts ok: 2 training, 2 held-out" in capsys.readouterr().out
    assert main(args + [f"data.task={bad}"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}, row 2: the prompt has 1 <image> markers but the row 0 images" in err, err
