"""Models: the tensor-parallel language model, its generation, its loaders and its memory estimate.

- `lm`: `TransformerLM` (GPT-2, Llama, BERT shapes over `tpcore.nn` blocks): construction,
  forward / backward, parameters, memory, and the stage interface a pipeline schedule
  drives (`tpcore.parallel.pipeline`).
- `moe_block`: `MoEBlock`, the Mixtral decoder layer (attention, norms, `tpcore.nn.moe.MoE`);
  its `build_blocks` makes TransformerLM's blocks (MoE ones when config.experts > 0).
- `norm`: the replicated norms outside the blocks and where the model's own arrays live.
- `generate`: generation (`TransformerLM.generate` and `iter_generate`; prompt and eos checks,
  the KV-cache decode loop).
- `sampling`: `SamplingParams` (temperature, top-k, top-p, min-p, penalties, seed, logprobs;
  generation_config defaults), `Sampler` (one request's penalties, filters and seeded draw),
  `sample_batch`, `TokenLogprob`.
- `text`: text in, text out: `Tokenizer` (a GGUF file's or a safetensors folder's tokenizer,
  special tokens, chat template), `load_tokenizer`, `IncrementalDetokenizer` (streamed text,
  whole characters), `StopMatcher` (stop strings across token boundaries).
- `chat_template`: `render_chat`, a chat template rendered in a Jinja sandbox.
- `text_generate`: `TransformerLM.chat` and `generate("text", stream=..., stop=...)` over
  `iter_generate`.
- `state`: the checkpoint state (`state_dict_full`, `load_state_dict_full`,
  `save_pretrained` of `TransformerLM`).
- `loader`: the checkpoint loaders, one per format behind `ModelLoader` (Hugging Face
  safetensors folders, tpcore's own folders, GGUF), and the entry points
  `from_pretrained` and `from_gguf`.
- `convert`: `quantize`, a copy of a model in another weight format.
- `hf`: Hugging Face config.json and tensor names to a `Config` and its tensors.
- `gguf`: GGUF metadata and tensors to a `Config`, quantized weights kept; the tokenizer.
- `memory`: `estimate_memory`, per-rank bytes before anything is allocated.

Inside, one way: loader and convert import lm (and text); lm imports generate, text_generate, state,
memory, norm, moe_block; those import norm, sampling, text, hf, gguf at most (generate reaches
text_generate by a call-time import for a text prompt; text reaches chat_template and gguf at call
time); nothing imports back up.

Imports: tpcore.utils, tpcore.distributed, tpcore.io, tpcore.nn.
"""
from tpcore.models.convert import quantize
from tpcore.models.lm import Config, TransformerLM, head_partition
from tpcore.models.loader import from_gguf, from_pretrained
from tpcore.models.memory import estimate_memory
from tpcore.models.sampling import Sampler, SamplingParams, TokenLogprob, sample_batch
from tpcore.models.chat_template import render_chat
from tpcore.models.text import IncrementalDetokenizer, StopMatcher, Tokenizer, load_tokenizer

__all__ = ["Config", "TransformerLM", "from_pretrained", "from_gguf", "head_partition", "quantize", "estimate_memory",
           "SamplingParams", "Sampler", "TokenLogprob", "sample_batch",
           "Tokenizer", "load_tokenizer", "IncrementalDetokenizer", "StopMatcher", "render_chat"]
