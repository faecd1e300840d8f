"""Adapters to the libraries people train with; each needs its optional extra.

- :mod:`scalestate.integrations.torchao`: torchao's float8 training with its
  casts scaled by a manager (``pip install "scalestate[torchao]"``).
- :mod:`scalestate.integrations.transformers`: a Hugging Face ``Trainer``
  callback that steps the manager and keeps its state in the Trainer's
  checkpoints (``pip install "scalestate[transformers]"``).

Nothing here is imported by ``import scalestate``.
"""
