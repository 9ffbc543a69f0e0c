"""Embeddings: a pooled request's prompt states, gathered chunk by chunk, made one vector.

A pooled sequence (``Sequence.pool``) is scheduled like any prompt, chunked under the step
budget, and finishes when its last prompt token is computed; it never samples. After each
step's forward the runner hands the step's hidden states here (:func:`pool_step`): the
final norm of the rows the pooling type reads (the last token's, the first's, or every
token's, summed), so nothing beyond a chunk's rows is kept between steps. A chunk computed
again after a preemption adds nothing twice (``PoolState.counted``).

A classifier's pooled state then goes through its ``score`` head (``LlamaModel.classify``):
the vector is one value per label, the activation applied unless the request says not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvrelay.protocol.pooling import ClassifierConfig, PoolerConfig, PoolingParams

if TYPE_CHECKING:
    from kvrelay.engine.models.llama import LlamaModel
    from kvrelay.engine.scheduler import StepPlan


@dataclass(slots=True)
class PoolState:
    """One pooled request's settings and what its computed chunks left."""

    pooling_type: str  # PoolerConfig.pooling_type
    normalize: bool  # embeddings: unit L2 norm; a classifier's scores: its activation
    dimensions: int | None
    activation: str | None  # a classifier's (ClassifierConfig.activation); None: an embedding
    total: torch.Tensor | None = None  # float32 [hidden]: CLS the first state, MEAN the sum
    counted: int = 0  # prompt tokens in ``total``
    embedding: torch.Tensor | None = None  # float32, set when the last prompt token is in

    @classmethod
    def resolve(
        cls,
        config: PoolerConfig,
        params: PoolingParams,
        classifier: ClassifierConfig | None = None,
    ) -> PoolState:
        asked = params.use_activation
        normalize = config.normalize if asked is None else asked
        activation = None if classifier is None else classifier.activation
        return cls(config.pooling_type, normalize, params.dimensions, activation)

    def finish(self, model: LlamaModel, state: torch.Tensor) -> torch.Tensor:
        """An embedding: the pooled ``state`` truncated to ``dimensions`` and normalized when
        asked. A classifier's: its head's logits, through its activation when asked."""
        if self.activation is not None:
            logits = model.classify(state)
            if not self.normalize or self.activation == "identity":
                return logits
            if self.activation == "sigmoid":
                return torch.sigmoid(logits)
            return torch.softmax(logits, dim=0)
        if self.dimensions is not None:
            state = state[: self.dimensions]
        if self.normalize:
            state = torch.nn.functional.normalize(state, dim=0)
        return state.contiguous()


def pool_step(model: LlamaModel, plan: StepPlan, hidden: torch.Tensor) -> None:
    """Adds this step's rows to each pooled sequence's state; sets ``embedding`` for those
    whose prompt the step completed."""
    row = 0
    for item in plan.scheduled:
        seq, start, n = item.seq, item.start, item.num_new_tokens
        state = seq.pool
        if state is not None:
            end = start + n
            if state.pooling_type == "LAST":
                if end == seq.num_tokens:
                    state.total = model.final_norm(hidden[row + n - 1 : row + n])[0].float()
            elif state.pooling_type == "CLS":
                if start == 0:
                    state.total = model.final_norm(hidden[row : row + 1])[0].float()
            else:  # MEAN: every token's state once, summed in float32
                first = max(start, state.counted)
                if first < end:
                    rows = model.final_norm(hidden[row + first - start : row + n]).float()
                    total = rows.sum(dim=0)
                    state.total = total if state.total is None else state.total + total
                    state.counted = end
            if end == seq.num_tokens:
                assert state.total is not None, "a pooled prompt's rows were all computed"
                pooled = (
                    state.total / seq.num_tokens if state.pooling_type == "MEAN" else state.total
                )
                state.embedding = state.finish(model, pooled).cpu()
        row += n
