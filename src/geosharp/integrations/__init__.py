"""Hooks into training frameworks.

:mod:`geosharp.integrations.hf_trainer` holds
:class:`~geosharp.integrations.hf_trainer.SharpnessCallback`, a Hugging Face
``transformers.TrainerCallback`` that measures geodesic and adaptive sharpness of the model
being trained every N optimizer steps and logs the values through the ``Trainer``. It is
imported from its module (``from geosharp.integrations.hf_trainer import SharpnessCallback``),
so that ``import geosharp`` never needs ``transformers``.
"""
