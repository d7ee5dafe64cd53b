"""The transformers attention function on one process: what it refuses, and its CP = 1 path.

Every option a Libra/Ulysses runner cannot compute is refused at the first layer's call with a
message naming it; without a runner the layer runs document-causal attention over its own tokens,
which must equal the stock model run on every document separately (float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the Hugging Face integration needs the [hf] extra (pip install -e '.[hf]')")

from libra.integrations.transformers import (  # noqa: E402
    IGNORE_INDEX,
    LocalAttention,
    attention_forward,
    collate_packed,
    register,
    shard_packed_batch,
)

QWEN3 = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, vocab_size=256)
LENGTHS = (5, 17, 1, 9, 32)


def _model(attn: str, checkpointing: bool = False, **overrides):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**{**QWEN3, **overrides}), attn_implementation=attn,
                                             dtype=torch.float64)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def _docs(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, QWEN3["vocab_size"], (n,), generator=g) for n in lengths]


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _reference(docs, state):
    """Stock sdpa Qwen3, every document its own sequence, loss over all labels of the batch."""
    model = _model("sdpa")
    model.load_state_dict(state)
    n = sum(len(d) - 1 for d in docs)
    total = 0.0
    for d in docs:
        loss = F.cross_entropy(model(input_ids=d[None], use_cache=False).logits[0, :-1], d[1:], reduction="sum") / n
        loss.backward()
        total += float(loss.detach())
    return total, _grads(model)


@pytest.mark.parametrize("checkpointing, flash_kwargs", [(False, False), (True, True)])
def test_without_a_runner_packed_equals_per_document_reference(checkpointing, flash_kwargs):
    docs = _docs()
    model = _model(register(), checkpointing)
    batch = collate_packed([{"input_ids": d} for d in docs])
    shard = shard_packed_batch(batch, 0, 1)
    extra = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")} if flash_kwargs else {}
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False, **extra).logits
    n = int((shard["shift_labels"] != IGNORE_INDEX).sum())
    assert n == sum(len(d) - 1 for d in docs)
    loss = F.cross_entropy(logits[0], shard["shift_labels"][0], ignore_index=IGNORE_INDEX, reduction="sum") / n
    loss.backward()
    ref_loss, ref_grads = _reference(docs, model.state_dict())
    assert abs(float(loss.detach()) - ref_loss) <= 1e-12 * abs(ref_loss)
    for name, g in _grads(model).items():
        assert float((g - ref_grads[name]).norm()) <= 1e-10 * float(ref_grads[name].norm()), name


def _forward(model, **kw):
    docs = _docs()
    shard = shard_packed_batch(collate_packed([{"input_ids": d} for d in docs]), kw.pop("cp_rank", 0),
                               kw.pop("cp_size", 1))
    return model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False, **kw)


def _runner():
    return LocalAttention(LENGTHS)


def test_rejects_dropout():
    with pytest.raises(ValueError, match="dropout 0.1"):
        _forward(_model(register(), attention_dropout=0.1), cp_runner=_runner())


def test_rejects_sliding_window():
    with pytest.raises(ValueError, match="sliding-window"):
        _forward(_model(register(), use_sliding_window=True, sliding_window=8, max_window_layers=0),
                 cp_runner=_runner())


def test_rejects_a_scaling_other_than_the_runners():
    with pytest.raises(ValueError, match="scales attention scores by 0.25 but the runner by 0.5"):
        _forward(_model(register()), cp_runner=LocalAttention(LENGTHS, scale=0.5))


def test_rejects_a_missing_runner_on_a_cp_slice():
    # rank 1 of CP 4 (tokens 16..31) starts inside the 17-token document: it cannot be the whole sequence
    with pytest.raises(ValueError, match="start inside a document .* pass the prepared runner"):
        _forward(_model(register()), cp_rank=1, cp_size=4)
    # documents that cover more tokens than this rank holds
    batch = collate_packed([{"input_ids": d} for d in _docs()])
    shard = shard_packed_batch(batch, 0, 2)
    with pytest.raises(ValueError, match="cover 64 tokens and this rank holds 32"):
        _model(register())(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False,
                           cu_seq_lens_q=batch["cu_seq_lens_q"])


def test_rejects_a_padding_mask():
    mask = torch.ones(1, sum(LENGTHS), dtype=torch.long)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="without padding"):
        _forward(_model(register()), attention_mask=mask, cp_runner=_runner())


def _qkv(batch=1, q_len=8, k_len=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 4, q_len, 16, generator=g, dtype=torch.float64),
            torch.randn(batch, 2, k_len, 16, generator=g, dtype=torch.float64),
            torch.randn(batch, 2, k_len, 16, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("kwargs, match", [
    ({"softcap": 30.0}, "soft-capping"),
    ({"s_aux": torch.zeros(4)}, "sinks"),
    ({"sinks": torch.zeros(4)}, "sinks"),
    ({"is_causal": False}, "bidirectional"),
])
def test_rejects_softcap_sinks_and_bidirectional(kwargs, match):
    module = torch.nn.Module()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        attention_forward(module, q, k, v, None, scaling=0.25, cp_runner=LocalAttention([8]), **kwargs)


def test_rejects_batches_masks_and_kv_caches():
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="one packed sequence per call"):
        attention_forward(module, *_qkv(batch=2), None, scaling=0.25, cp_runner=LocalAttention([8]))
    with pytest.raises(ValueError, match="KV cache"):
        attention_forward(module, *_qkv(q_len=1, k_len=8), None, scaling=0.25, cp_runner=LocalAttention([1]))
    with pytest.raises(ValueError, match="dense or custom attention mask"):
        attention_forward(module, *_qkv(), torch.zeros(1, 1, 8, 8), scaling=0.25, cp_runner=LocalAttention([8]))


def test_attention_function_layout_and_return():
    q, k, v = _qkv()
    out, weights = attention_forward(torch.nn.Module(), q, k, v, None, scaling=0.25, position_ids=torch.arange(8)[None])
    assert weights is None and out.shape == (1, 8, 4, 16)  # (batch, T, heads, d) as transformers reshapes it
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_register_names():
    from transformers import AttentionInterface, AttentionMaskInterface

    assert register("libra-test") == "libra-test"
    assert AttentionInterface()["libra-test"] is attention_forward
    assert AttentionMaskInterface()["libra-test"] is not None
    for bad in ("sdpa", "eager", "flash_attention_2", "", "paged|x"):
        with pytest.raises(ValueError, match="new attention name"):
            register(bad)
