"""The GPU model's code path (TransformerLM with its tensors outside the layers as
DeviceArrays and the d_ kernels: embeddings sums, norms, the tied head's GEMMs, row
gathers in generate, loss and backward, the optimizers' device steps) run on the CPU
(_device_path=True: DeviceArrays of the CPU), against the NumPy path of the same model:
the same kernels in the same order, so logits, greedy tokens, losses and updated
weights agree bit for bit.  On a machine with a GPU, tests/devices/test_gpu.py runs the same
path on CUDA against the CPU model."""
import numpy as np
import pytest

import tpcore
from conftest import BF16, rng_for, run

MODELS = {
    "gpt2_tied": dict(vocab_size=53, hidden=24, layers=2, heads=6, ffn_hidden=36, max_positions=64,
                      tie_embeddings=True),
    "llama_untied": dict(vocab_size=53, hidden=24, layers=2, heads=6, kv_heads=2, head_dim=4, ffn_hidden=36,
                         norm="rmsnorm", activation="swiglu", positions="rope", bias=False, max_positions=64,
                         tie_embeddings=False, model_type="llama"),
    "bert": dict(vocab_size=41, hidden=24, layers=2, heads=4, ffn_hidden=40, max_positions=32, type_vocab_size=2,
                 causal=False, pre_norm=False, embedding_norm=True, final_norm=False, model_type="bert"),
}


def _case(comm, name, dtype):
    cfg = tpcore.Config(**MODELS[name])
    a = tpcore.models.TransformerLM(cfg, comm, seed=3, dtype=dtype)
    b = tpcore.models.TransformerLM(cfg, comm, seed=3, dtype=dtype, _device_path=True)
    g = rng_for(71, 0)
    tok = g.integers(0, cfg.vocab_size, (2, 6))
    errs = []
    if not np.array_equal(a.logits(tok), b.logits(tok)):
        errs.append("logits differ")
    if name == "bert":
        tt = g.integers(0, 2, tok.shape)
        mask = np.ones(tok.shape, np.uint8)
        mask[1, 4:] = 0
        if not np.array_equal(a.encode(tok, attention_mask=mask, token_type_ids=tt),
                              b.encode(tok, attention_mask=mask, token_type_ids=tt)):
            errs.append("encode differs")
    else:
        prompts = [list(tok[0, :2]), list(tok[1, :5])]  # uneven prompts: the last-row gather
        ga, gb = a.generate(prompts, max_new_tokens=5), b.generate(prompts, max_new_tokens=5)
        if len(ga) != len(gb) or not all(np.array_equal(x, y) for x, y in zip(ga, gb)):
            errs.append(f"greedy tokens differ: {ga} vs {gb}")
    oa, ob = tpcore.optim.AdamW(a, lr=1e-2), tpcore.optim.AdamW(b, lr=1e-2)
    targets = np.roll(tok, -1, 1)
    targets[0, -1] = -100  # an ignored row
    for step in range(3):
        la, lb = a.loss(tok, targets), b.loss(tok, targets)
        if la != lb:
            errs.append(f"step {step}: loss {la} vs {lb}")
        a.backward()
        b.backward()
        oa.step()
        ob.step()
        a.zero_grad()
        b.zero_grad()
    sa, sb = a.state_dict_full(), b.state_dict_full()
    for k in sa:
        if not np.array_equal(np.asarray(sa[k]).astype(np.float32), np.asarray(sb[k]).astype(np.float32)):
            errs.append(f"{k} differs after training")
    if any(isinstance(p, tpcore.DeviceArray) for p, _ in a.parameters()):
        errs.append("the NumPy path holds DeviceArrays")
    kinds = {type(p).__name__ for p, _ in b.parameters()}
    if name != "llama_untied" and "DeviceArray" not in kinds:
        errs.append(f"the device path's replicated parameters are {kinds}")
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_device_path_equals_numpy_path(world, name):
    for r, errs in enumerate(run(_case, world, name, "float32")):
        assert not errs, f"rank {r}: {errs}"


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
@pytest.mark.parametrize("name", ["gpt2_tied", "llama_untied"])
def test_device_path_equals_numpy_path_bf16(name):
    for r, errs in enumerate(run(_case, 2, name, "bfloat16")):
        assert not errs, f"rank {r}: {errs}"
