"""The training thread: the one hook between logging steps, and the hooks of a logging step.

* :mod:`~actviz.capture.root_hook`: the one forward pre-hook left on the model between logging steps;
* :mod:`~actviz.capture.compiled_model`: the user's model under ``torch.compile``: logging steps run eagerly;
* :mod:`~actviz.capture.step_capture`: :class:`StepCapture`, the hooks of one logging step;
* :mod:`~actviz.capture.layer_outputs`: what a layer's output becomes: its summaries and pictures;
* :mod:`~actviz.capture.output_gradients`: the hooks on each layer's output's gradient, on the op that made it;
* :mod:`~actviz.capture.step_parameters`: the watched parameters: values, and gradients as applied;
* :mod:`~actviz.capture.step_end`: a logging step's stage, and when it ends (backward, optimizer step, next forward);
* :mod:`~actviz.capture.open_steps`: the logging steps still open, and the order they leave in;
* :mod:`~actviz.capture.layer_slots`: where each watched layer sits, to follow a layer replaced after watch();
* :mod:`~actviz.capture.transformer_step`: a step's attention calls and transformer statistics;
* :mod:`~actviz.capture.probe`: a fixed probe input through the model on image steps;
* :mod:`~actviz.capture.amp`: a GradScaler's scale, read without a sync.

Example:
    >>> import tempfile, torch, actviz
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> viz = actviz.watch(model, tempfile.mkdtemp(), every=2)
    >>> len(model._forward_pre_hooks), len(model[0]._forward_hooks)  # between logging steps: one hook, on the root
    (1, 0)
    >>> viz.close()
    >>> len(model._forward_pre_hooks)
    0
"""
