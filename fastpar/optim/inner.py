"""What an optimizer that steps another one (``MasterWeights``, ``DistributedOptimizer``) shows
of it: torch's ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, so LR
schedulers and users read and change the hyper-parameters that are really used."""

from __future__ import annotations


class InnerOptimizerView:
    """Mixin: ``self.inner`` is the optimizer that holds the groups and the state."""

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults
