"""The architectures of the coverage sweep: each built tiny from its config, with its inputs.

:data:`ARCHITECTURES` lists one :class:`Architecture` per model family (BERT to Wav2Vec2, and
``torch.nn`` attention): a builder (``transformers.<Model>(<Config>(...))`` at tiny sizes, float64,
eval mode, every parameter nudged by ``0.05·N(0, 1)`` with seed 0, no download), an input draw
and a forward that returns all outputs as one tensor; ``float32`` says why a model computes part
of its forward in float32. Measured by :mod:`geosharp.demos.coverage_sweep`; a new row of the
table is a new entry here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["ARCHITECTURES", "Architecture"]

DT = torch.float64

D, HEADS, HEAD_DIM, LAYERS, FFN, VOCAB, SEQ = 32, 4, 8, 2, 37, 64, 7


@dataclass(frozen=True)
class Architecture:
    """One architecture of the sweep.

    Attributes:
        name: Display name.
        build: Builds the model from its config (float64, eval mode, weights nudged).
        inputs: Draws the inputs from a generator.
        forward: Runs the model on the inputs; returns one tensor (all outputs concatenated).
        float32: Why the model computes part of its forward in float32 (then the tolerance is
            :data:`~geosharp.demos.coverage_sweep.FLOAT32_TOL`), or ``None``.
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple]
    forward: Callable[[nn.Module, tuple], Tensor]
    float32: str | None = None


# -- the architectures ----------------------------------------------------------------------------
def _seeded(fn: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = fn().to(DT).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return model

    return build


def _ids(g: torch.Generator, batch: int = 2, seq: int = SEQ, low: int = 3) -> Tensor:
    return torch.randint(low, VOCAB, (batch, seq), generator=g)


def _mask(batch: int = 2, seq: int = SEQ) -> Tensor:
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - 2 :] = 0
    return mask


def _cat(*parts: Tensor | None) -> Tensor:
    return torch.cat([p.reshape(-1) for p in parts if p is not None])


def _text_inputs(g: torch.Generator) -> tuple:
    return (_ids(g), _mask())


def _encoder_forward(m: nn.Module, x: tuple) -> Tensor:
    out = m(input_ids=x[0], attention_mask=x[1])
    return _cat(out.last_hidden_state, getattr(out, "pooler_output", None))


def _decoder_forward(m: nn.Module, x: tuple) -> Tensor:
    return m(input_ids=x[0], use_cache=False).last_hidden_state


def _decoder_inputs(g: torch.Generator) -> tuple:
    return (_ids(g),)


def _hf(config_cls: str, model_cls: str, **kw: object) -> Callable[[], nn.Module]:
    """A builder of ``transformers.<model_cls>(<config_cls>(**kw))``.

    The attention runs through ``torch.nn.functional.scaled_dot_product_attention`` (float64
    throughout) where the model supports it, else through its eager code: several eager
    implementations compute the softmax in float32, which the check would see (a Q/K group
    element shifts every score of a query by the same ``q·A⁻¹b_k``, invisible to an exact
    softmax but not to its float32 rounding).
    """

    def build() -> nn.Module:
        import transformers

        config_type = getattr(transformers, config_cls)
        model_type = getattr(transformers, model_cls)
        try:
            return model_type(config_type(**{"attn_implementation": "sdpa", **kw}))
        except ValueError as err:
            if "does not support" not in str(err):
                raise
            return model_type(config_type(**{**kw, "attn_implementation": "eager"}))

    return _seeded(build)


#: The sizes of a BERT-style config (text, vision and audio towers alike).
_SIZES = dict(
    hidden_size=D, num_attention_heads=HEADS, num_hidden_layers=LAYERS, intermediate_size=FFN
)
#: The sizes of an encoder-decoder config with BART's field names (BART, Whisper).
_ENCODER_DECODER = dict(
    vocab_size=VOCAB,
    d_model=D,
    encoder_layers=LAYERS,
    decoder_layers=LAYERS,
    encoder_attention_heads=HEADS,
    decoder_attention_heads=HEADS,
    encoder_ffn_dim=FFN,
    decoder_ffn_dim=FFN,
)
_BERTLIKE = dict(_SIZES, vocab_size=VOCAB, max_position_embeddings=16)
_DECODER = dict(_SIZES, vocab_size=VOCAB, max_position_embeddings=32)
_GQA = dict(_DECODER, num_key_value_heads=2)

#: Reasons why a model computes part of its float64 forward in float32.
_F32_QK = "Q·Kᵀ in float32"
_F32_SOFTMAX = "softmax in float32"
_F32_NORM = "RMSNorm output rounded to float32"
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _encoder(name: str, config_cls: str, model_cls: str, **kw: object) -> Architecture:
    return Architecture(
        name, _hf(config_cls, model_cls, **{**_BERTLIKE, **kw}), _text_inputs, _encoder_forward
    )


def _decoder(
    name: str, config_cls: str, model_cls: str, float32: str | None = None, **kw: object
) -> Architecture:
    return Architecture(
        name,
        _hf(config_cls, model_cls, **{**_DECODER, **_TOKENS, **kw}),
        _decoder_inputs,
        _decoder_forward,
        float32,
    )


def _seq2seq_forward(m: nn.Module, x: tuple) -> Tensor:
    out = m(input_ids=x[0], attention_mask=x[1], decoder_input_ids=x[2], use_cache=False)
    return _cat(out.last_hidden_state, out.encoder_last_hidden_state)


def _seq2seq_inputs(g: torch.Generator) -> tuple:
    return (_ids(g), _mask(), _ids(g, seq=5))


def _pixels(g: torch.Generator, size: int = 8) -> tuple:
    return (torch.randn(2, 3, size, size, generator=g, dtype=DT),)


def _vision_forward(m: nn.Module, x: tuple) -> Tensor:
    out = m(pixel_values=x[0])
    return _cat(out.last_hidden_state, getattr(out, "pooler_output", None))


_VISION = dict(_SIZES, image_size=8, patch_size=4)


def _dual_inputs(g: torch.Generator) -> tuple:
    # the CLIP text tower pools at the EOS token (id 2 here); put it last so that it attends to
    # every token
    ids = _ids(g)
    ids[:, -1] = 2
    return ids, torch.randn(2, 3, 8, 8, generator=g, dtype=DT)


def _dual_forward(m: nn.Module, x: tuple) -> Tensor:
    out = m(input_ids=x[0], pixel_values=x[1])
    return _cat(out.logits_per_image, out.text_embeds, out.image_embeds)


def _dual(name: str, config_cls: str, model_cls: str) -> Architecture:
    text = dict(_SIZES, vocab_size=VOCAB, max_position_embeddings=16, **_TOKENS)
    kw: dict = dict(text_config=text, vision_config=dict(_VISION))
    if config_cls == "CLIPConfig":
        kw["projection_dim"] = 16
    return Architecture(name, _hf(config_cls, model_cls, **kw), _dual_inputs, _dual_forward)


def _whisper() -> Architecture:
    mels, frames = 8, 16

    def inputs(g: torch.Generator) -> tuple:
        return torch.randn(2, mels, frames, generator=g, dtype=DT), _ids(g, seq=5)

    def forward(m: nn.Module, x: tuple) -> Tensor:
        out = m(input_features=x[0], decoder_input_ids=x[1], use_cache=False)
        return _cat(out.last_hidden_state, out.encoder_last_hidden_state)

    build = _hf(
        "WhisperConfig",
        "WhisperModel",
        **_ENCODER_DECODER,
        **_TOKENS,
        num_mel_bins=mels,
        max_source_positions=frames // 2,
        max_target_positions=16,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return Architecture("Whisper", build, inputs, forward)


def _wav2vec2() -> Architecture:
    def inputs(g: torch.Generator) -> tuple:
        return (torch.randn(2, 400, generator=g, dtype=DT),)

    def forward(m: nn.Module, x: tuple) -> Tensor:
        return m(input_values=x[0]).last_hidden_state

    build = _hf(
        "Wav2Vec2Config",
        "Wav2Vec2Model",
        **_SIZES,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        vocab_size=VOCAB,
    )
    return Architecture("Wav2Vec2", build, inputs, forward)


class _TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` as a self-attention layer with a key padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def _torch_archs() -> list[Architecture]:
    def mha_inputs(g: torch.Generator) -> tuple:
        return torch.randn(2, SEQ, D, generator=g, dtype=DT), _mask() == 0

    def transformer_inputs(g: torch.Generator) -> tuple:
        return (
            torch.randn(2, SEQ, D, generator=g, dtype=DT),
            torch.randn(2, 5, D, generator=g, dtype=DT),
        )

    def transformer_forward(m: nn.Module, x: tuple) -> Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=DT)
        return m(x[0], x[1], tgt_mask=causal)

    transformer = _seeded(
        lambda: nn.Transformer(D, HEADS, LAYERS, LAYERS, FFN, dropout=0.0, batch_first=True)
    )
    return [
        Architecture(
            "torch MultiheadAttention", _seeded(_TorchMHA), mha_inputs, lambda m, x: m(*x)
        ),
        Architecture("torch Transformer", transformer, transformer_inputs, transformer_forward),
    ]


def _architectures() -> list[Architecture]:
    t5 = dict(
        vocab_size=VOCAB,
        d_model=D,
        d_kv=HEAD_DIM,
        num_heads=HEADS,
        num_layers=LAYERS,
        d_ff=FFN,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
    )
    bart = dict(_ENCODER_DECODER, max_position_embeddings=16, **_TOKENS)
    return [
        _encoder("BERT", "BertConfig", "BertModel"),
        _encoder("RoBERTa", "RobertaConfig", "RobertaModel", pad_token_id=1),
        _encoder("XLM-R", "XLMRobertaConfig", "XLMRobertaModel", pad_token_id=1),
        _encoder("ELECTRA", "ElectraConfig", "ElectraModel", embedding_size=16),
        Architecture(
            "DistilBERT",
            _hf(
                "DistilBertConfig",
                "DistilBertModel",
                vocab_size=VOCAB,
                dim=D,
                n_heads=HEADS,
                n_layers=LAYERS,
                hidden_dim=FFN,
                max_position_embeddings=16,
            ),
            _text_inputs,
            _encoder_forward,
        ),
        _encoder("ALBERT", "AlbertConfig", "AlbertModel", embedding_size=16),
        _encoder(
            "DeBERTa-v2",
            "DebertaV2Config",
            "DebertaV2Model",
            relative_attention=True,
            pos_att_type=["c2p", "p2c"],
            position_buckets=4,
            max_relative_positions=8,
            share_att_key=True,
            norm_rel_ebd="layer_norm",
        ),
        # MPNet's encoder computes the position bias with 32 buckets whatever the config says
        _encoder("MPNet", "MPNetConfig", "MPNetModel", pad_token_id=1),
        _decoder(
            "GPT-2",
            "GPT2Config",
            "GPT2Model",
            n_embd=D,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=32,
        ),
        _decoder(
            "GPT-Neo",
            "GPTNeoConfig",
            "GPTNeoModel",
            _F32_QK,
            num_layers=LAYERS,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            num_heads=HEADS,
        ),
        _decoder(
            "GPT-J",
            "GPTJConfig",
            "GPTJModel",
            n_embd=D,
            n_layer=LAYERS,
            n_head=HEADS,
            rotary_dim=4,
            n_positions=32,
            n_inner=FFN,
        ),
        _decoder(
            "GPT-NeoX",
            "GPTNeoXConfig",
            "GPTNeoXModel",
            rotary_pct=0.5,
            partial_rotary_factor=0.5,
        ),
        _decoder(
            "OPT",
            "OPTConfig",
            "OPTModel",
            ffn_dim=FFN,
            word_embed_proj_dim=D,
        ),
        _decoder("BLOOM", "BloomConfig", "BloomModel", _F32_SOFTMAX, n_layer=LAYERS, n_head=HEADS),
        _decoder(
            "Falcon",
            "FalconConfig",
            "FalconModel",
            new_decoder_architecture=True,
            num_kv_heads=2,
            alibi=False,
            bias=True,
        ),
        Architecture(
            "BART", _hf("BartConfig", "BartModel", **bart), _seq2seq_inputs, _seq2seq_forward
        ),
        Architecture("T5", _hf("T5Config", "T5Model", **t5), _seq2seq_inputs, _seq2seq_forward),
        _decoder("Llama", "LlamaConfig", "LlamaModel", _F32_NORM, **_GQA, attention_bias=True),
        _decoder("Mistral", "MistralConfig", "MistralModel", _F32_NORM, **_GQA, sliding_window=4),
        _decoder(
            "Mixtral",
            "MixtralConfig",
            "MixtralModel",
            _F32_NORM,
            **_GQA,
            experts_implementation="eager",
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        _decoder("Qwen2", "Qwen2Config", "Qwen2Model", _F32_NORM, **_GQA),
        _decoder("Qwen3", "Qwen3Config", "Qwen3Model", _F32_NORM, **_GQA, head_dim=HEAD_DIM),
        _decoder("Gemma", "GemmaConfig", "GemmaModel", _F32_NORM, **_GQA, head_dim=HEAD_DIM),
        _decoder("Gemma2", "Gemma2Config", "Gemma2Model", _F32_NORM, **_GQA, head_dim=HEAD_DIM),
        _decoder("OLMo2", "Olmo2Config", "Olmo2Model", _F32_NORM, **_GQA),
        _decoder("StableLM", "StableLmConfig", "StableLmModel", **_GQA),
        _decoder("Phi", "PhiConfig", "PhiModel", partial_rotary_factor=0.5),
        _decoder("Phi3", "Phi3Config", "Phi3Model", _F32_NORM, **_GQA, partial_rotary_factor=0.5),
        Architecture("ViT", _hf("ViTConfig", "ViTModel", **_VISION), _pixels, _vision_forward),
        Architecture("DeiT", _hf("DeiTConfig", "DeiTModel", **_VISION), _pixels, _vision_forward),
        Architecture(
            "Swin",
            _hf(
                "SwinConfig",
                "SwinModel",
                image_size=16,
                patch_size=2,
                embed_dim=16,
                depths=[2, 1],
                num_heads=[2, 4],
                window_size=2,
                mlp_ratio=2.0,
            ),
            lambda g: _pixels(g, 16),
            _vision_forward,
        ),
        _dual("CLIP", "CLIPConfig", "CLIPModel"),
        _dual("SigLIP", "SiglipConfig", "SiglipModel"),
        _whisper(),
        _wav2vec2(),
        *_torch_archs(),
    ]


#: The architectures of the sweep, in table order.
ARCHITECTURES: list[Architecture] = _architectures()
