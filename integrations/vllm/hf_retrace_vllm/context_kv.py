"""The drafter's context K/V, written when it is next read rather than every engine step.

Every step the target verifies `R` rows, and the drafter's context needs the `fc` of their features at those
positions. Writing them at once costs a K/V projection through every drafter layer and a cache insert each step,
also in the steps where no request drafts (a lookup or the datastore proposes, or nothing pays), which are most
steps. `DeferredContextKV` keeps those rows instead and writes them in one call:

- before the next drafter forward (its `block_forward` then writes that step's own rows after them);
- at the first step a request is missing from the batch (finished, aborted or preempted): its blocks may go to another
  request, whose rows are newer and written after; and a prefix-cache hit on its blocks finds their drafter K/V;
- when the kept rows reach `max_rows` (memory: `max_rows x hidden` floats).

Order is what keeps it exact: rows are written oldest first, and where two kept rows share a cache slot (a rejected
draft's row, then the committed token's row at the same position) only the newer one is written. Attention of the
drafter only reads positions before a block's anchor, which are written by then; the target's output never depends on
it (the drafter proposes, the target verifies).
"""

import torch


class DeferredContextKV:
    """Context rows of the drafter's K/V cache kept until a write is due (module docstring).

    Args:
        max_rows (`int`): most rows kept before they are written (the proposer passes vLLM's
            `max_num_batched_tokens`); 0 writes every step's rows at once.
    """

    def __init__(self, max_rows: int):
        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {max_rows}")
        self.max_rows = max_rows
        self._steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (features, positions, slots)
        self._req_ids: set = set()  # requests with kept rows
        self.num_rows = 0

    def add(self, req_ids, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Keeps one step's rows: `features` `[R, H]` (`fc` of the target's features), `positions` and `slots` `[R]`
        (copied: vLLM reuses its buffers), for the requests `req_ids`."""
        self._steps.append((features, positions.clone(), slots.clone()))
        self._req_ids.update(req_ids)
        self.num_rows += features.shape[0]

    def due(self, req_ids) -> bool:
        """Whether the kept rows must be written now: a request that has kept rows is not in this step's `req_ids`,
        or they are more than `max_rows`."""
        if not self._steps:
            return False
        return self.num_rows > self.max_rows or not self._req_ids.issubset(req_ids)

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The kept rows to write, oldest first, one per cache slot (the newest), and forgets them. Returns
        `(features [N, H], positions [N], slots [N])`, or `None` when none is kept."""
        if not self._steps:
            return None
        features, positions, slots = (torch.cat(parts) for parts in zip(*self._steps))
        self._steps, self._req_ids, self.num_rows = [], set(), 0
        unique, inverse = torch.unique(slots, return_inverse=True)
        if unique.numel() < slots.numel():  # a slot written twice: keep its last row
            order = torch.arange(slots.numel(), device=slots.device)
            last = torch.full_like(unique, -1).scatter_reduce(0, inverse, order, reduce="amax")
            last = last.sort().values  # oldest first
            features, positions, slots = features[last], positions[last], slots[last]
        return features, positions, slots
