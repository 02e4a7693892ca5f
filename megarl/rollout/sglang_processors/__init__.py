"""Multimodal processors that megarl's SGLang servers load (SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE: SGLang imports every
module of this package inside the server and lets its processors replace its own for their architectures). Imported
only there: the modules import sglang."""
