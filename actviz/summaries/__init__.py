"""Summaries: a tensor reduced on its device to one header row and a sample, finished on the host.

* :mod:`~actviz.summaries.header`: the header row's layout (``FIELDS``, :class:`Reduction`), written once and
  decoded once;
* :mod:`~actviz.summaries.one_tensor`: :func:`reduce_tensor` (the one-pass op, the compiled header or the CPU
  shortcut), :func:`finish` (the host half) and :func:`summarize` (both, for one tensor);
* :mod:`~actviz.summaries.one_pass`: ``torch.ops.actviz.summarize``, tensors' rows and samples in one op, each
  read once; :mod:`~actviz.summaries.one_pass_triton`, its CUDA body, and :mod:`~actviz.summaries.one_pass_tables`,
  the tables its kernels read; :mod:`~actviz.summaries.outlier_moments`,
  the outlier numbers of its eager body;
* :mod:`~actviz.summaries.cpu_shortcut`: a float CPU tensor's numbers read at once, in float64;
* :mod:`~actviz.summaries.fused`: the header in one compiled kernel (Inductor);
* :mod:`~actviz.summaries.small_tensors`: tensors no larger than their sample, batched per step;
* :mod:`~actviz.summaries.segments`: many consecutive segments of one tensor reduced together;
* :mod:`~actviz.summaries.many_tensors`: parameters and gradients reduced together in a fixed number of ops;
* :mod:`~actviz.summaries.piecewise`: huge tensors (in the eager body) and integers, a slice at a time;
* :mod:`~actviz.summaries.merge_ranks`: ``merge_ranks=True``: one step's summaries merged over every rank.

Statistics beyond the header (outliers, logits, unit counts) are :mod:`actviz.statistics`.

Example:
    >>> import torch
    >>> from actviz.summaries.one_tensor import finish, reduce_tensor
    >>> summary = finish(reduce_tensor(torch.tensor([1.0, -2.0, 0.0])), bins=2)
    >>> summary.min, summary.max, summary.zeros
    (-2.0, 1.0, 1)
"""
