"""The inputs a step takes whether or not any row uses them, kept on device for the steps that
do not: an all-ones grammar mask where no row is constrained, zeros for the stop ids held back
and the logit biases where no row has any, zeros for the logprob inputs where no row wants
token_ids_logprob or prompt positions. Such a step moves nothing more to the
device than its own rows' inputs (model/compute/step_inputs.py HostBatch)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ringserve.model.compute.mesh import place_host_array
from ringserve.model.compute.step_inputs import BAN_IDS, BIAS_IDS, Buckets, HostBatch, LogprobBatch


class StepConstants:
    def __init__(self, sharding: Any, mask_words: int, token_ids_logprob_num: int, buckets: Buckets):
        self.sharding, self.mask_words = sharding, mask_words
        self.token_ids_logprob_num, self.buckets = token_ids_logprob_num, buckets
        self._all_allowed: dict[int, jax.Array] = {}  # samples per step -> an all-ones mask
        self._zeros: dict[tuple[Any, ...], jax.Array] = {}  # (dtype, shape) -> zeros

    def sampling(self, hb: HostBatch) -> Any:
        """The step's sampling inputs with a grammar mask: the rows' (model/compute/step_inputs.py), or
        when no row is constrained the all-ones one (sent once); likewise zeros for the stop ids
        held back and the logit biases where no row has any."""
        smp, r, n = hb.sampling, hb.shape.rows, hb.shape.rows * max(1, hb.shape.verify)
        if smp.ban is None:
            smp = smp._replace(ban=self._zeros_of(r, BAN_IDS))
        if smp.bias_ids is None:
            smp = smp._replace(bias_ids=self._zeros_of(r, BIAS_IDS), bias=self._zeros_of(r, BIAS_IDS, dtype=np.float32))
        if smp.mask is not None:
            if smp.mask.shape != (n, self.mask_words):
                raise ValueError(f"grammar masks of shape {smp.mask.shape}, expected {(n, self.mask_words)}")
            return smp
        ones = self._all_allowed.get(n)
        if ones is None:
            ones = self._all_allowed[n] = place_host_array(np.full((n, self.mask_words), -1, np.int32), self.sharding)
        return smp._replace(mask=ones)

    def logprob(self, hb: HostBatch) -> LogprobBatch:
        """The step's logprob inputs (model/compute/step_inputs.py LogprobBatch): the rows', or zeros
        (sent once) where no row wants token_ids_logprob or prompt positions."""
        lb, r, p = hb.logprob, hb.shape.rows, self.buckets.positions(hb.shape)
        if lb.ids is None:
            lb = lb._replace(ids=self._zeros_of(r, self.token_ids_logprob_num))
        if p and lb.index is None:
            z = self._zeros_of(p)
            lb = lb._replace(index=z, target=z, row=z, count=self._zeros_of())
        return lb

    def _zeros_of(self, *shape: int, dtype: Any = np.int32) -> jax.Array:
        key = (np.dtype(dtype).name, *shape)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = place_host_array(np.zeros(shape, dtype), self.sharding)
        return z
