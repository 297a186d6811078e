"""Models: the tensor-parallel language model, its loaders and its memory estimate.

- `lm`: `TransformerLM` (GPT-2, Llama, BERT shapes over `tpcore.nn` blocks), generation,
  `quantize`, and the loaders `from_pretrained` (Hugging Face safetensors, tpcore's own
  folders) and `from_gguf`.
- `hf`: Hugging Face config.json and tensor names to a `Config` and its tensors.
- `gguf`: GGUF metadata and tensors to a `Config`, quantized weights kept; the tokenizer.
- `memory`: `estimate_memory`, per-rank bytes before anything is allocated.

Imports: tpcore.utils, tpcore.distributed, tpcore.io, tpcore.nn.
"""
from tpcore.models.lm import (Config, TransformerLM, estimate_memory, from_gguf, from_pretrained, head_partition,
                              quantize)

__all__ = ["Config", "TransformerLM", "from_pretrained", "from_gguf", "head_partition", "quantize", "estimate_memory"]
