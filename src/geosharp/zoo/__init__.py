"""Loaders for the paper's model populations (SPEC §7); no weights or data ship with geosharp.

- :mod:`geosharp.zoo.clip_soups`: the 72 model-soups fine-tunes of CLIP ViT-B/32 on ImageNet
  (``model_i.pt`` state dicts in OpenAI-CLIP layout with a linear head) →
  :func:`load_clip_soup`, :func:`list_clip_soups`, :func:`clip_preprocess`.
- :mod:`geosharp.zoo.bert_mnli`: McCoy et al.'s 100 BERT-base fine-tunes on MNLI (TensorFlow 1
  checkpoints, read without TensorFlow, or Hugging Face folders) → :func:`load_bert_mnli`,
  :func:`list_bert_mnli`.

Every loader returns an ``nn.Module`` in eval mode whose attention
:func:`geosharp.find_symmetries` recognises (fused ``nn.MultiheadAttention`` for CLIP, the
Hugging Face ``BertAttention`` layout for BERT). Where the checkpoints come from, how to run a
study on them and what it costs on a GPU: ``docs/paper_populations.md``.

Example:
    >>> from geosharp import zoo
    >>> zoo.NUM_SOUP_MODELS, zoo.NUM_MNLI_MODELS, zoo.MNLI_LABELS
    (72, 100, ('contradiction', 'entailment', 'neutral'))
"""

from geosharp.zoo._tf_checkpoint import TFCheckpoint
from geosharp.zoo.bert_mnli import (
    MNLI_LABELS,
    NUM_MNLI_MODELS,
    bert_tf_to_hf_name,
    load_bert_mnli,
)
from geosharp.zoo.bert_mnli import list_population as list_bert_mnli
from geosharp.zoo.clip_soups import (
    CLIP_MEAN,
    CLIP_STD,
    NUM_SOUP_MODELS,
    CLIPClassifier,
    OpenAIVisionTransformer,
    clip_preprocess,
    load_clip_soup,
)
from geosharp.zoo.clip_soups import list_population as list_clip_soups

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "MNLI_LABELS",
    "NUM_MNLI_MODELS",
    "NUM_SOUP_MODELS",
    "CLIPClassifier",
    "OpenAIVisionTransformer",
    "TFCheckpoint",
    "bert_tf_to_hf_name",
    "clip_preprocess",
    "list_bert_mnli",
    "list_clip_soups",
    "load_bert_mnli",
    "load_clip_soup",
]
