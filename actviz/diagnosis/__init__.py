"""Diagnosis: what the writer thread adds to a step, and ``actviz doctor``.

* :mod:`~actviz.diagnosis.step_diagnosis`: :class:`Diagnosis`, called with each step's results;
* :mod:`~actviz.diagnosis.alerts`: health alerts, rules over a step's statistics;
* :mod:`~actviz.diagnosis.trends`: the alerts that compare a layer with its own history;
* :mod:`~actviz.diagnosis.transformer_alerts`: the rules over transformer statistics;
* :mod:`~actviz.diagnosis.flow`: flow pictures, every layer over time;
* :mod:`~actviz.diagnosis.spikes`: the spike recorder (``watch(extras=[Spikes()])``);
* :mod:`~actviz.diagnosis.silences`: why a run logs nothing, said once;
* :mod:`~actviz.diagnosis.doctor`: ``actviz doctor RUN_DIR``.

Example:
    >>> from actviz.diagnosis.alerts import check_alerts
    >>> check_alerts({"vanishing_ratio": 1e-4})["vanishing_ratio"]
    0.0001
"""
