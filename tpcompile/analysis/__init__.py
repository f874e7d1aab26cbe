"""The analysis stage: every parameter's role read off the captured dataflow.

* :mod:`~tpcompile.analysis.propagate` — the engine: rules (:mod:`tpcompile.rules`) carry
  *atoms* (output features of a weight) through the graph and tie the ones that must
  share a rank; :mod:`~tpcompile.analysis.partition` deals the tied units to ranks;
* :mod:`~tpcompile.analysis.roles` — column / row / vocab-parallel / replicated, to a
  fixed point (regions that cannot be split exactly are replicated and re-propagated);
* :mod:`~tpcompile.analysis.fixups` — hard-coded sizes made rank-local, proven by
  re-tracing; :mod:`~tpcompile.analysis.selfcheck` — the localized model traced before
  any weight moves;
* :mod:`~tpcompile.analysis.tokens` — which ops are token-local (sequence parallelism).
"""
