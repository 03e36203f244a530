"""Leaves every stage may import: they import nothing else of actviz.

* :mod:`~actviz.common.results`: what a step logs, on the host (:class:`Summary`, :class:`StepResults`);
* :mod:`~actviz.common._internals`: every private PyTorch, TensorBoard and torchvision API, one function each;
* :mod:`~actviz.common.owned_hooks`: the hook objects a watcher owns, weakly held, inert when copied or pickled;
* :mod:`~actviz.common.optimizer_steps`: the process's one optimizer step pre-hook and post-hook;
* :mod:`~actviz.common.distributed_types`: DTensor, FSDP and DDP recognised by class name;
* :mod:`~actviz.common.pixels`: values in [0, 1] to uint8 pixels, and heat maps as palette indices;
* :mod:`~actviz.common.safe_warnings`: warnings that never stop training, even under ``-W error``;
* :mod:`~actviz.common.notices`: what a watcher tells its user, once per run;
* :mod:`~actviz.common.suggestions`: the "did you mean" of every error.

Example:
    >>> from actviz.common.results import StepResults
    >>> StepResults(3, scalars={"loss": 0.5}).scalars
    {'loss': 0.5}
"""
