"""Inside an SGLang server of a Qwen2.5-VL policy: SGLang's Qwen-VL processor, with megarl's processor_output items
decoded first (their tensors travel base64-encoded over HTTP: megarl/rollout/sglang_images.py)."""

from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor

from megarl.rollout.sglang_images import decode_item


class MegarlQwenVLProcessor(QwenVLImageProcessor):
    models = [Qwen2_5_VLForConditionalGeneration]

    async def process_mm_data_async(self, image_data, input_text, request_obj, *args, **kwargs):
        if isinstance(image_data, list):
            image_data = [decode_item(item) for item in image_data]
        return await super().process_mm_data_async(image_data, input_text, request_obj, *args, **kwargs)
