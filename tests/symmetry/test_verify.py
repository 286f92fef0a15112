"""No claim without proof: prove(find_symmetries(model), model, inputs) drops the false ones."""

import torch
from torch import nn

from geosharp.symmetry import ADAPTERS, find_symmetries, prove
from geosharp.symmetry.adapters import _separate_linear_claim, llama_attention

from .cases import llama_case

DT = torch.float64


def rotary_blind_llama(path, module):
    """A wrong adapter: Llama attention with the rotary embeddings overlooked (full GL Q/K)."""
    if llama_attention(path, module) is None:
        return None
    cfg = module.config
    h = cfg.hidden_size // cfg.num_attention_heads
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    return _separate_linear_claim(
        path, module, names, cfg.num_attention_heads, h, num_kv_heads=cfg.num_key_value_heads
    )


def test_false_claims_are_dropped_with_a_note():
    case = llama_case()
    model = case.build()
    (ids,) = case.inputs(torch.Generator().manual_seed(0))
    adapters = [rotary_blind_llama, *ADAPTERS]
    blind = find_symmetries(model, adapters=adapters)
    # the claim, unproven: full GL on Q/K and a free key bias (both false under RoPE)
    assert [b.kind for b in blind.blocks] == ["QK", "b_k", "VO"] * 2
    assert any("unverified" in n for n in blind.notes)
    space = prove(find_symmetries(model, adapters=adapters), model, {"input_ids": ids})
    assert [b.kind for b in space.blocks] == ["VO", "VO"]  # the false claims fell
    dropped = [n for n in space.notes if "dropped" in n]
    assert len(dropped) == 4 and "'layers.0.self_attn[QK]' (GLBlock) dropped" in dropped[0]
    assert "'layers.0.self_attn[b_k]' (TranslationBlock) dropped" in dropped[1]
    assert "2 of 6 blocks hold" in space.notes[-1]
    # the dropped coordinates are adaptive again
    assert space.adaptive_numel == blind.adaptive_numel + sum(
        b.numel for b in blind.blocks if b.kind in ("QK", "b_k")
    )


def test_correct_claims_are_verified():
    case = llama_case()
    model = case.build()
    (ids,) = case.inputs(torch.Generator().manual_seed(0))
    space = prove(find_symmetries(model), model, {"input_ids": ids})
    assert [b.kind for b in space.blocks] == ["QK", "VO"] * 2
    assert any(
        n.startswith("symmetry claims verified on the example batch: 4 blocks") for n in space.notes
    )


class MyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        return self.qkv(x)


def test_unknown_attention_modules_are_named():
    model = nn.Sequential(MyAttention(), nn.Linear(24, 2))
    notes = find_symmetries(model).notes
    assert any(
        n.startswith("attention module MyAttention (e.g. '0') is not understood") for n in notes
    )
