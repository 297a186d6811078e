"""Tensor-parallel generation from a safetensors checkpoint, the same tokens at 1 and N ranks.

    python examples/generate_safetensors.py                          # a small random GPT-2, 2 ranks
    python examples/generate_safetensors.py --model-type llama -n 3  # a random Llama (GQA, RoPE)
    python examples/generate_safetensors.py --checkpoint DIR -n 4 --prompt "Once upon a time"

DIR is a local Hugging Face GPT-2 or Llama directory (config.json + *.safetensors, e.g. from
`huggingface-cli download gpt2 --local-dir DIR`); with its tokenizer.json, --prompt text is
tokenized with `tokenizers` and the output decoded.  With no --checkpoint, a small random
model is written to a temporary directory in Hugging Face's layout (save_pretrained(...,
hf=True): config.json + model.safetensors, the files transformers reads) and loaded back.

tpcore.models.from_pretrained(DIR, comm) gives each rank only its slices (attention heads,
MLP columns, vocabulary rows), read memory-mapped; generate() runs a batched prefill into
the KV cache, then greedy decoding, for prompts of different lengths.  Rank 0 first runs
the same checkpoint alone (a communicator of one rank) as the reference.  When
transformers is installed, its model of the same files decodes greedily too.  Checks
(exit status 1 when one fails): the N-rank tokens equal the 1-rank tokens and
transformers' tokens.  Every run decodes all --new tokens (eos ignored) so they compare.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

import tpcore

SMALL = {"gpt2": dict(vocab_size=300, hidden=64, layers=2, heads=4, ffn_hidden=160, max_positions=64,
                      activation="gelu_tanh", positions="learned", model_type="gpt2"),
         "llama": dict(vocab_size=300, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=96, max_positions=64,
                       norm="rmsnorm", activation="swiglu", positions="rope", bias=False, tie_embeddings=False,
                       model_type="llama")}


def write_random(comm, path, model_type, layers, hidden, seed):
    """A random model saved in Hugging Face's layout (collective: rank 0 writes the full tensors)."""
    kw = dict(SMALL[model_type], layers=layers, hidden=hidden)
    model = tpcore.models.TransformerLM(tpcore.Config(**kw), comm, seed=seed)
    model.save_pretrained(path, hf=True)


def generate(comm, path, prompts, new):
    model = tpcore.models.from_pretrained(path, comm, progress=False)
    model.generate([p[:2] for p in prompts], max_new_tokens=2, eos_token_id=-1)  # warm-up
    comm.barrier()
    t = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=new, eos_token_id=-1)
    return out, time.perf_counter() - t, repr(model)


def job(comm, path, prompts, new):
    """Every rank: (tokens at comm.size ranks, seconds, the model); rank 0 also one rank's."""
    solo = comm.split(0 if comm.rank == 0 else None)
    ref = generate(solo, path, prompts, new) if solo is not None else None
    if solo is not None:
        solo.close()
    comm.barrier()
    return generate(comm, path, prompts, new), ref


def transformers_tokens(path, prompts, new):
    """Greedy decoding by transformers' model of the same files (a plain loop over the full
    sequence, no cache), or None when transformers (or torch) is not installed."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    import transformers
    transformers.logging.set_verbosity_error()  # e.g. GPT2Config's default eos id 50256, outside a small vocab
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor(np.asarray(p)[None], dtype=torch.long)
            for _ in range(new):
                nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
            outs.append(ids[0].numpy())
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--checkpoint", default=None, help="a local Hugging Face GPT-2 / Llama directory "
                                                       "(default: write a small random one)")
    ap.add_argument("--model-type", choices=sorted(SMALL), default="gpt2", help="the random model's kind")
    ap.add_argument("--layers", type=int, default=2, help="the random model's blocks (default 2)")
    ap.add_argument("--hidden", type=int, default=64, help="the random model's width (default 64)")
    ap.add_argument("--prompt", action="append", default=None,
                    help="prompt text (repeatable; needs the checkpoint's tokenizer.json)")
    ap.add_argument("--new", type=int, default=12, help="tokens to generate (default 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-transformers", action="store_true", help="skip the comparison with transformers")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.checkpoint
        if path is None:
            path = os.path.join(tmp, "model")
            tpcore.spawn(write_random, a.n, args=(path, a.model_type, a.layers, a.hidden, a.seed), deadline=600)
            print(f"wrote a random {a.model_type} checkpoint: {sorted(os.listdir(path))}")
        tok = None
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        if a.prompt:
            if tok is None:
                ap.error("--prompt needs a checkpoint with a tokenizer.json")
            prompts = [np.array(tok.encode(t).ids, np.int64) for t in a.prompt]
        else:  # random token ids, prompts of two different lengths
            vocab = tpcore.Config.from_hf(path).vocab_size
            g = np.random.default_rng(a.seed)
            prompts = [g.integers(0, vocab, n) for n in (5, 9)]
        (out, secs, desc), ref = tpcore.spawn(job, a.n, args=(path, prompts, a.new), deadline=1200)[0]
        print(f"{desc}\n{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, {a.new} new tokens each, greedy")
        for p, o in zip(prompts, out):
            new = o[len(p):]
            text = f"  {tok.decode(new.tolist())!r}" if tok is not None else ""
            print(f"  prompt {p.tolist()} -> {new.tolist()}{text}")
        print(f"generate: {ref[1] * 1e3:.1f} ms at 1 rank, {secs * 1e3:.1f} ms at {a.n} ranks")
        ok = all(np.array_equal(o, r) for o, r in zip(out, ref[0]))
        print(f"tokens at {a.n} ranks equal the 1-rank run: {'yes' if ok else 'NO'}")
        if not a.no_transformers:
            hf = transformers_tokens(path, prompts, a.new)
            if hf is None:
                print("transformers is not installed: comparison skipped")
            else:
                same = all(np.array_equal(o, h) for o, h in zip(out, hf))
                print(f"tokens equal transformers' greedy decoding of the same files: {'yes' if same else 'NO'}")
                ok &= same
    print("check passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
