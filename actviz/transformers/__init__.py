"""Transformers: the attention calls of a logging forward, their statistics and pictures.

* :mod:`~actviz.transformers.attention`: ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` calls;
* :mod:`~actviz.transformers.attention_stats`: attention statistics from a call's own q and k, pure tensor functions;
* :mod:`~actviz.transformers.attention_maps`: attention pictures of the probe, and attention rollout.

Example:
    >>> import torch
    >>> from actviz.transformers.attention_stats import attention_logits, attention_stats
    >>> q = torch.randn(1, 2, 5, 4)
    >>> tuple(attention_stats(attention_logits(q, q, rows=4)).shape)  # max logit; per row: entropy, sink, keys
    (2, 13)
"""
