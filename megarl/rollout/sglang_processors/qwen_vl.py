"""Inside an SGLang server of a Qwen2.5-VL policy: SGLang's Qwen-VL processor, with megarl's processor_output items
decoded first (their tensors travel base64-encoded over HTTP: megarl/rollout/sglang_images.py).

The HF processor SGLang loads at start-up: transformers 5's Qwen2_5_VLProcessor needs torchvision for its video
processor, which the GPU bundle may not have (AutoProcessor then raises ImportError and the server does not start).
megarl sends processed images only, so SGLang's processor needs the tokenizer (its image tokens' ids) and nothing
else: without torchvision this module's loader (SGLang's _CUSTOMIZED_MM_PROCESSOR registry, read before the
processor is loaded) gives the tokenizer alone (raw images sent to such a server cannot be processed: megarl never
sends any; transformers' AutoImageProcessor wants torchvision too)."""

from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from sglang.srt.multimodal.customized_mm_processor_utils import _CUSTOMIZED_MM_PROCESSOR
from sglang.srt.multimodal.processors.qwen_vl import QwenVLImageProcessor

from megarl.rollout.sglang_images import decode_item


class MegarlQwenVLProcessor(QwenVLImageProcessor):
    models = [Qwen2_5_VLForConditionalGeneration]

    async def process_mm_data_async(self, image_data, input_text, request_obj, *args, **kwargs):
        if isinstance(image_data, list):
            image_data = [decode_item(item) for item in image_data]
        return await super().process_mm_data_async(image_data, input_text, request_obj, *args, **kwargs)


class TokenizerProcessor:
    """transformers' processor where it loads; else the tokenizer alone (module docstring)."""

    image_processor = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, path, *args, trust_remote_code=False, revision=None, **kwargs):
        from transformers import AutoProcessor, AutoTokenizer

        try:
            return AutoProcessor.from_pretrained(path, *args, trust_remote_code=trust_remote_code, revision=revision,
                                                 **kwargs)
        except ImportError:
            return cls(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision))


_CUSTOMIZED_MM_PROCESSOR.setdefault("qwen2_5_vl", TokenizerProcessor)
